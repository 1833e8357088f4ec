// hvdcomp's hand-written CPU kernels for the single-resolution max-norm codec (hvdcomp/codec/native.py
// compiles this file at first use, for the machine it runs on, and calls it through ctypes).
//
// They compute exactly what the eager reference in hvdcomp/codec/quantize.py and random.py computes:
// the same float32 operations in the same order (built with -ffp-contract=off), the same Philox4x32-7
// draws, the same blocked word order (hvdcomp/codec/packing.py). tests/test_native.py checks it bit for bit.
//
// Layouts (B = 16 words per lane block, L lanes per word, values in the blocked order):
//   lane l of word B k + j holds value L B k + B l + j, shifted left by l * width.
// Ranges passed in are whole lane blocks: [first, last) values with first and last multiples of L B.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockWords = 16;  // packing.LANE_BLOCK_WORDS
constexpr int64_t kChunk = 4096;     // at most this many values per pass through the stack buffers
// A kernel call that writes at least this many float32 means (1 MiB, a bucket's; tests/test_native.py's
// STREAM_VALUES) stores them past the caches: nothing reads them before the optimizer, and a plain store first reads
// each line from memory (docs/benchmarks.md#means-stored-past-the-caches).
constexpr int64_t kStreamValues = int64_t{1} << 18;
constexpr uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kKeyStep0 = 0x9E3779B9u, kKeyStep1 = 0xBB67AE85u;
constexpr int kRounds = 7;                    // random.PHILOX_ROUNDS
constexpr float kUniformUnit = 1.0f / 65536;  // 2**-UNIFORM_BITS

struct Stream {
  uint32_t key0, key1, step0, step1;  // random.stream_words: key words, then counter words 2 and 3
};

inline float uniform_of(uint32_t bits16) { return (static_cast<float>(bits16) + 0.5f) * kUniformUnit; }

// Philox4x32-7 of counter block j: the 8 uniforms of elements 8 j .. 8 j + 7 (high halves of words 0..3,
// then their low halves) into u[0..8).
inline void draw_block(uint64_t j, const Stream& s, float* u) {
  uint32_t c0 = static_cast<uint32_t>(j), c1 = static_cast<uint32_t>(j >> 32), c2 = s.step0, c3 = s.step1;
  uint32_t k0 = s.key0, k1 = s.key1;
  for (int round = 0; round < kRounds; ++round) {
    if (round) {
      k0 += kKeyStep0;
      k1 += kKeyStep1;
    }
    const uint64_t p0 = static_cast<uint64_t>(c0) * kMultiplier0, p1 = static_cast<uint64_t>(c2) * kMultiplier1;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  const uint32_t words[4] = {c0, c1, c2, c3};
  for (int r = 0; r < 4; ++r) {
    u[r] = uniform_of(words[r] >> 16);
    u[r + 4] = uniform_of(words[r] & 0xFFFFu);
  }
}

// Whether group ends (cumulative: group g is values [ends[g - 1], ends[g])) are in order and within numel values.
bool ends_within(const int64_t* ends, int64_t groups, int64_t numel) {
  for (int64_t g = 0, begin = 0; g < groups; begin = ends[g++])
    if (ends[g] < begin || ends[g] > numel) return false;
  return true;
}

// A flat vector's values held as pieces one after another (a bucket's gradients, read in place: no copy into a flat
// buffer): piece p holds values [ends[p - 1], ends[p]) at data[p]; a flat tensor is one piece. Plus a sparse addend
// (an excess owed from earlier steps, hvdcomp/codec/agreed.py): value added_at[k] reads as itself plus added[k] (one
// float32 addition, as torch's index_add_), added_at strictly ascending.
struct Pieces {
  const float* const* data;
  const int64_t* ends;  // cumulative
  int64_t count;
  const int64_t* added_at;
  const float* added;
  int64_t added_count;

  // Whether the ends are in order and end at numel (no piece: numel 0), and the addend (given where it has places)
  // ascends strictly within them.
  bool fit(int64_t numel) const {
    if (!ends_within(ends, count, numel) || (count ? ends[count - 1] : 0) != numel || added_count < 0 ||
        (added_count > 0 && (added_at == nullptr || added == nullptr)))
      return false;
    for (int64_t k = 0; k < added_count; ++k)
      if (added_at[k] < (k ? added_at[k - 1] + 1 : 0) || added_at[k] >= numel) return false;
    return true;
  }

  // Values [start, start + n) (within the pieces): where one piece holds them all and nothing is added to them, a
  // pointer into it; else gathered into scratch (room for n values) with the addend, which is returned.
  const float* span(int64_t start, int64_t n, float* scratch) const {
    if (n <= 0) return scratch;
    const int64_t* first_added = std::lower_bound(added_at, added_at + added_count, start);
    const int64_t* end_added = std::lower_bound(first_added, added_at + added_count, start + n);
    int64_t p = std::upper_bound(ends, ends + count, start) - ends;  // the piece that holds value start
    int64_t begin = p ? ends[p - 1] : 0;
    if (start + n <= ends[p] && first_added == end_added) return data[p] + (start - begin);
    for (int64_t at = start; at < start + n; begin = ends[p++]) {
      const int64_t stop = std::min(ends[p], start + n);
      std::copy(data[p] + (at - begin), data[p] + (stop - begin), scratch + (at - start));
      at = stop;
    }
    for (const int64_t* k = first_added; k != end_added; ++k) scratch[*k - start] += added[k - added_at];
    return scratch;
  }
};

// maxima[g] <- the max of maxima[g] and the finite |x_i| of group g (ends cumulative, as fill_factors), for values
// start .. start + n - 1 at x[0..n); returns whether any of them is NaN or infinite (quantize.local_stats).
bool group_maxima(const float* x, int64_t start, int64_t n, const int64_t* ends, int64_t groups, float* maxima) {
  int64_t g = std::upper_bound(ends, ends + groups, start) - ends;
  int64_t i = 0;
  bool nonfinite = false;
  for (; i < n && g < groups; ++g) {
    const int64_t stop = std::min(ends[g] - start, n);
    float high = maxima[g];
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(FLT_MAX);
    __m256 highs = _mm256_set1_ps(high);
    int bad = 0;
    for (; i + 8 <= stop; i += 8) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
      const __m256 finite = _mm256_cmp_ps(a, largest, _CMP_LE_OQ);  // false for NaN and infinity
      bad |= _mm256_movemask_ps(finite) ^ 0xFF;
      highs = _mm256_max_ps(highs, _mm256_and_ps(a, finite));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, highs);
    for (float lane : lanes) high = std::max(high, lane);
    nonfinite |= bad != 0;
#endif
    for (; i < stop; ++i) {
      const float a = std::fabs(x[i]);
      if (a <= FLT_MAX) {
        high = std::max(high, a);
      } else {
        nonfinite = true;
      }
    }
    maxima[g] = high;
  }
  return nonfinite;
}

#if defined(__AVX2__)
// High and low words of a * m in each of 8 lanes (m: the multiplier in every lane).
inline void mulhilo8(__m256i a, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                       // 64-bit products of lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // of lanes 1, 3, 5, 7
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

inline __m256 uniforms8(__m256i bits16) {
  return _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(bits16), _mm256_set1_ps(0.5f)),
                       _mm256_set1_ps(kUniformUnit));
}

// Rows r0..r7 (row r: draw r of each of 8 blocks, one block per lane) transposed into u[0..64): row i of the
// transpose, the 8 draws of block i, at u + 8 i (element order).
inline void store_transposed(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6, __m256 r7,
                             float* u) {
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 q0 = _mm256_shuffle_ps(t0, t2, 0x44), q1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 q2 = _mm256_shuffle_ps(t1, t3, 0x44), q3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 q4 = _mm256_shuffle_ps(t4, t6, 0x44), q5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 q6 = _mm256_shuffle_ps(t5, t7, 0x44), q7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(u + 0, _mm256_permute2f128_ps(q0, q4, 0x20));
  _mm256_storeu_ps(u + 8, _mm256_permute2f128_ps(q1, q5, 0x20));
  _mm256_storeu_ps(u + 16, _mm256_permute2f128_ps(q2, q6, 0x20));
  _mm256_storeu_ps(u + 24, _mm256_permute2f128_ps(q3, q7, 0x20));
  _mm256_storeu_ps(u + 32, _mm256_permute2f128_ps(q0, q4, 0x31));
  _mm256_storeu_ps(u + 40, _mm256_permute2f128_ps(q1, q5, 0x31));
  _mm256_storeu_ps(u + 48, _mm256_permute2f128_ps(q2, q6, 0x31));
  _mm256_storeu_ps(u + 56, _mm256_permute2f128_ps(q3, q7, 0x31));
}

// The 64 uniforms of 8 Philox outputs (c0..c3: word r of blocks j .. j + 7, one block per lane) into u[0..64) in
// element order: draw r of a block is the high half of its word r, draw r + 4 the low half.
inline void store_uniforms(__m256i c0, __m256i c1, __m256i c2, __m256i c3, float* u) {
  const __m256i low_half = _mm256_set1_epi32(0xFFFF);
  store_transposed(uniforms8(_mm256_srli_epi32(c0, 16)), uniforms8(_mm256_srli_epi32(c1, 16)),
                   uniforms8(_mm256_srli_epi32(c2, 16)), uniforms8(_mm256_srli_epi32(c3, 16)),
                   uniforms8(_mm256_and_si256(c0, low_half)), uniforms8(_mm256_and_si256(c1, low_half)),
                   uniforms8(_mm256_and_si256(c2, low_half)), uniforms8(_mm256_and_si256(c3, low_half)), u);
}

// AVX2's operations for philox_sets: 8 blocks per vector.
struct Avx2Ops {
  using V = __m256i;
  static V splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static void mulhilo(V a, V m, V* hi, V* lo) { mulhilo8(a, m, hi, lo); }
  static V xor3(V a, V b, V c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
};

// Philox4x32-7 of kSets sets of blocks, one block per 32-bit lane: c0, c1 hold each block's counter words 0 and 1 (words
// 2 and 3 are the stream's); c0..c3 <- output word r of each block. Ops: the vector type's operations (Avx2Ops,
// Avx512Ops). The sets' rounds interleave, so one set's multiplies run while another's wait
// (docs/benchmarks.md#the-draw-and-the-lane-reads).
template <typename Ops, int kSets>
inline void philox_sets(typename Ops::V* c0, typename Ops::V* c1, typename Ops::V* c2, typename Ops::V* c3,
                        const Stream& s) {
  using V = typename Ops::V;
  for (int set = 0; set < kSets; ++set) {
    c2[set] = Ops::splat(s.step0);
    c3[set] = Ops::splat(s.step1);
  }
  uint32_t k0 = s.key0, k1 = s.key1;
  const V m0 = Ops::splat(kMultiplier0), m1 = Ops::splat(kMultiplier1);
  for (int round = 0; round < kRounds; ++round) {
    if (round) {
      k0 += kKeyStep0;
      k1 += kKeyStep1;
    }
    const V key0 = Ops::splat(k0), key1 = Ops::splat(k1);
    for (int set = 0; set < kSets; ++set) {
      V hi0, lo0, hi1, lo1;
      Ops::mulhilo(c0[set], m0, &hi0, &lo0);
      Ops::mulhilo(c2[set], m1, &hi1, &lo1);
      c0[set] = Ops::xor3(hi1, c1[set], key0);
      c1[set] = lo1;
      c2[set] = Ops::xor3(hi0, c3[set], key1);
      c3[set] = lo0;
    }
  }
}

// Blocks j .. j + 8 kSets - 1 (sets of 8, one block per lane) into u[0 .. 64 kSets) in element order.
template <int kSets>
inline void draw_blocks(uint64_t j, const Stream& s, float* u) {
  __m256i c0[kSets], c1[kSets], c2[kSets], c3[kSets];
  for (int set = 0; set < kSets; ++set) {
    alignas(32) uint32_t low[8], high[8];
    for (int i = 0; i < 8; ++i) {
      const uint64_t block = j + 8 * set + i;
      low[i] = static_cast<uint32_t>(block);
      high[i] = static_cast<uint32_t>(block >> 32);
    }
    c0[set] = _mm256_load_si256(reinterpret_cast<const __m256i*>(low));
    c1[set] = _mm256_load_si256(reinterpret_cast<const __m256i*>(high));
  }
  philox_sets<Avx2Ops, kSets>(c0, c1, c2, c3, s);
  for (int set = 0; set < kSets; ++set) store_uniforms(c0[set], c1[set], c2[set], c3[set], u + 64 * set);
}
#endif

#if defined(__AVX512F__)
// High and low words of a * m in each of 16 lanes (m: the multiplier in every lane).
inline void mulhilo16(__m512i a, __m512i m, __m512i* hi, __m512i* lo) {
  const __m512i even = _mm512_mul_epu32(a, m);                       // 64-bit products of the even lanes
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);  // of the odd lanes
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

// AVX-512's operations for philox_sets: 16 blocks per vector, the three-way XOR in one instruction.
struct Avx512Ops {
  using V = __m512i;
  static V splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static void mulhilo(V a, V m, V* hi, V* lo) { mulhilo16(a, m, hi, lo); }
  static V xor3(V a, V b, V c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
};

inline __m512 uniforms16(__m512i bits16) {
  return _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(bits16), _mm512_set1_ps(0.5f)),
                       _mm512_set1_ps(kUniformUnit));
}

inline __m256 low_half_of(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half_of(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// Blocks j .. j + 16 kSets - 1 (sets of 16, one block per lane) into u[0 .. 128 kSets) in element order: draw_blocks
// at twice the width, the same transpose per 8 blocks (docs/benchmarks.md#the-draw-at-avx-512-width).
template <int kSets>
inline void draw_blocks16(uint64_t j, const Stream& s, float* u) {
  __m512i c0[kSets], c1[kSets], c2[kSets], c3[kSets];
  const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  for (int set = 0; set < kSets; ++set) {  // 64-bit block numbers of lanes 0..7 and 8..15, split into two halves
    const __m512i first = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(j + 16 * set)), lane);
    const __m512i second = _mm512_add_epi64(first, _mm512_set1_epi64(8));
    const __m512i gather_low = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i gather_high = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    c0[set] = _mm512_permutex2var_epi32(first, gather_low, second);
    c1[set] = _mm512_permutex2var_epi32(first, gather_high, second);
  }
  philox_sets<Avx512Ops, kSets>(c0, c1, c2, c3, s);
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  for (int set = 0; set < kSets; ++set) {
    const __m512 r0 = uniforms16(_mm512_srli_epi32(c0[set], 16)), r1 = uniforms16(_mm512_srli_epi32(c1[set], 16));
    const __m512 r2 = uniforms16(_mm512_srli_epi32(c2[set], 16)), r3 = uniforms16(_mm512_srli_epi32(c3[set], 16));
    const __m512 r4 = uniforms16(_mm512_and_si512(c0[set], low_half));
    const __m512 r5 = uniforms16(_mm512_and_si512(c1[set], low_half));
    const __m512 r6 = uniforms16(_mm512_and_si512(c2[set], low_half));
    const __m512 r7 = uniforms16(_mm512_and_si512(c3[set], low_half));
    float* out = u + 128 * set;
    store_transposed(low_half_of(r0), low_half_of(r1), low_half_of(r2), low_half_of(r3), low_half_of(r4),
                     low_half_of(r5), low_half_of(r6), low_half_of(r7), out);
    store_transposed(high_half_of(r0), high_half_of(r1), high_half_of(r2), high_half_of(r3), high_half_of(r4),
                     high_half_of(r5), high_half_of(r6), high_half_of(r7), out + 64);
  }
}
#endif

// The uniforms of elements first .. first + n - 1 (first and n multiples of 8) into u[0..n).
void draw(int64_t first, int64_t n, const Stream& s, float* u) {
  const uint64_t j0 = static_cast<uint64_t>(first / 8);
  const int64_t blocks = n / 8;
  int64_t b = 0;
#if defined(__AVX512F__)
  for (; b + 32 <= blocks; b += 32) draw_blocks16<2>(j0 + b, s, u + 8 * b);
#endif
#if defined(__AVX2__)
  for (; b + 16 <= blocks; b += 16) draw_blocks<2>(j0 + b, s, u + 8 * b);
  for (; b + 8 <= blocks; b += 8) draw_blocks<1>(j0 + b, s, u + 8 * b);
#endif
  for (; b < blocks; ++b) draw_block(j0 + b, s, u + 8 * b);
}

// factors[0..n): the factor of each value start .. start + n - 1 from per-group factors (group g ends before
// value ends[g], cumulative), 0 past the last group.
void fill_factors(int64_t start, int64_t n, const int64_t* ends, const float* group_factors, int64_t groups,
                  float* factors) {
  int64_t g = std::upper_bound(ends, ends + groups, start) - ends;
  int64_t i = 0;
  for (; i < n && g < groups; ++g) {  // ends[g] > start + i: each group's stop is at least i
    const int64_t stop = std::min(ends[g] - start, n);
    std::fill(factors + i, factors + stop, group_factors[g]);
    i = stop;
  }
  std::fill(factors + i, factors + n, 0.0f);
}

#if defined(__AVX2__)
// out[0..8) <- v: streamed past the caches (stream: a call of at least kStreamValues means) where out is 32-byte
// aligned, else a plain store. A kernel that streams ends with end_streaming.
inline void store_means8(float* out, __m256 v, bool stream) {
  if (stream && (reinterpret_cast<uintptr_t>(out) & 31) == 0) {
    _mm256_stream_ps(out, v);
  } else {
    _mm256_storeu_ps(out, v);
  }
}
#endif

// Orders a kernel's streamed stores (store_means8) before anything its caller does next.
inline void end_streaming([[maybe_unused]] bool stream) {
#if defined(__AVX2__)
  if (stream) _mm_sfence();
#endif
}

#if defined(__AVX2__)
// Lane values (below 2**31) of 8 consecutive words as int32: (word >> shift) & mask. A logical shift: the masked
// bits lie below bit 63 - shift, where it equals the reference's arithmetic one.
inline __m256i lanes_of_8_words(const int64_t* words, __m128i shift, __m256i masks) {
  const __m256i a = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)),
                                                      shift), masks);
  const __m256i b = _mm256_and_si256(
      _mm256_srl_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 4)), shift), masks);
  // the low 32 bits of words 0, 1, 4, 5 | 2, 3, 6, 7, then the middle 64-bit pairs swapped: words 0 .. 7 in order,
  // two shuffles where three cross-lane permutes cost more (docs/benchmarks.md#the-draw-and-the-lane-reads)
  const __m256 low_halves = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _MM_SHUFFLE(2, 0, 2, 0));
  return _mm256_permute4x64_epi64(_mm256_castps_si256(low_halves), _MM_SHUFFLE(3, 1, 2, 0));
}

// The 16 values of one lane of a block of 16 words (lane values and offset below 2**31): (lane - offset) * factor,
// factor factors[j] of value j, or factors[0] for all of them (kOneFactor: values of one scale group).
template <bool kOneFactor>
inline void decode_lane_avx2(const int64_t* words, int64_t shift, int64_t mask, int64_t offset, const float* factors,
                             bool stream, float* out) {
  const __m128i count = _mm_cvtsi64_si128(shift);
  const __m256i masks = _mm256_set1_epi64x(mask), offsets = _mm256_set1_epi32(static_cast<int>(offset));
  for (int j = 0; j < kBlockWords; j += 8) {
    const __m256 values = _mm256_cvtepi32_ps(_mm256_sub_epi32(lanes_of_8_words(words + j, count, masks), offsets));
    const __m256 scale = kOneFactor ? _mm256_set1_ps(factors[0]) : _mm256_loadu_ps(factors + j);
    store_means8(out + j, _mm256_mul_ps(values, scale), stream);
  }
}

// Words 0 .. 3 of `sums` at dst: as int64, or (float_words) as float64 of the same values, each below 2**52 (the
// float carrier, hvdcomp/codec/carrier.py): OR-ing in the exponent of 2**52 gives 2**52 + w exactly, and subtracting
// 2**52 leaves w.
inline void store_4_words(__m256i sums, bool float_words, int64_t* dst) {
  if (!float_words) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), sums);
    return;
  }
  const __m256d two52 = _mm256_set1_pd(4503599627370496.0);
  _mm256_storeu_pd(reinterpret_cast<double*>(dst),
                   _mm256_sub_pd(_mm256_or_pd(_mm256_castsi256_pd(sums), two52), two52));
}

// The words of n values at x (whole lane blocks, all of one scale group, whose factor is `factor`) into words[0 ..
// n / L): hvdcomp_encode's levels with uniforms noise[0 .. n), packed as pack_lane_blocks packs them (float_words: as
// float64), 8 values at a time, the same float32 operations. kStats: also *high <- max(*high, their finite |x|), and
// whether one of them is NaN or infinite (returned; else false).
template <bool kStats>
inline bool encode_one_group_avx2(const float* x, const float* noise, int64_t n, float factor, int64_t coarse,
                                  int64_t lanes, int64_t width, bool float_words, int64_t* words, float* high) {
  const __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(FLT_MAX), factors = _mm256_set1_ps(factor);
  const __m256 limit = _mm256_set1_ps(static_cast<float>(coarse));
  const __m256i offset = _mm256_set1_epi32(static_cast<int>(coarse));
  __m256 highs = _mm256_setzero_ps();
  int bad = 0;
  const int64_t per_block = kBlockWords * lanes;
  for (int64_t k = 0; k < n / per_block; ++k) {
    __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t l = 0; l < lanes; ++l) {
      const __m128i shift = _mm_cvtsi64_si128(l * width);
      for (int h = 0; h < 2; ++h) {
        const int64_t i = k * per_block + l * kBlockWords + 8 * h;
        const __m256 v = _mm256_loadu_ps(x + i), a = _mm256_andnot_ps(sign, v);
        if (kStats) {
          const __m256 finite = _mm256_cmp_ps(a, largest, _CMP_LE_OQ);  // false for NaN and infinity
          bad |= _mm256_movemask_ps(finite) ^ 0xFF;
          highs = _mm256_max_ps(highs, _mm256_and_ps(a, finite));
        }
        const __m256 level = _mm256_min_ps(  // min_ps(a, b): a < b ? a : b, so a NaN level becomes the limit
            _mm256_round_ps(_mm256_add_ps(_mm256_mul_ps(a, factors), _mm256_loadu_ps(noise + i)),
                            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
            limit);
        const __m256i lane =
            _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_or_ps(level, _mm256_and_ps(v, sign))), offset);
        const __m256i lower = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(lane));  // values i .. i + 3
        const __m256i upper = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(lane, 1));  // i + 4 .. i + 7
        sums[2 * h] = _mm256_add_epi64(sums[2 * h], _mm256_sll_epi64(lower, shift));
        sums[2 * h + 1] = _mm256_add_epi64(sums[2 * h + 1], _mm256_sll_epi64(upper, shift));
      }
    }
    for (int q = 0; q < 4; ++q) store_4_words(sums[q], float_words, words + k * kBlockWords + 4 * q);
  }
  if (kStats) {
    alignas(32) float lanes_high[8];
    _mm256_store_ps(lanes_high, highs);
    for (float lane : lanes_high) *high = std::max(*high, lane);
  }
  return bad != 0;
}

#if defined(__AVX512F__)
// Words 0 .. 7 of `sums` at dst, as store_4_words stores 4.
inline void store_8_words(__m512i sums, bool float_words, int64_t* dst) {
  if (!float_words) {
    _mm512_storeu_si512(dst, sums);
    return;
  }
  const __m512d two52 = _mm512_set1_pd(4503599627370496.0);
  _mm512_storeu_pd(reinterpret_cast<double*>(dst),
                   _mm512_sub_pd(_mm512_castsi512_pd(_mm512_or_si512(sums, _mm512_castpd_si512(two52))), two52));
}

// encode_one_group_avx2 at twice the width: the 16 values of one lane of a block at a time, the same float32
// operations (docs/benchmarks.md#the-draw-at-avx-512-width).
template <bool kStats>
inline bool encode_one_group_avx512(const float* x, const float* noise, int64_t n, float factor, int64_t coarse,
                                    int64_t lanes, int64_t width, bool float_words, int64_t* words, float* high) {
  const __m512 largest = _mm512_set1_ps(FLT_MAX), factors = _mm512_set1_ps(factor);
  const __m512 limit = _mm512_set1_ps(static_cast<float>(coarse));
  const __m512i offset = _mm512_set1_epi32(static_cast<int>(coarse)), sign = _mm512_set1_epi32(INT32_MIN);
  __m512 highs = _mm512_setzero_ps();
  __mmask16 all_finite = 0xFFFF;
  const int64_t per_block = kBlockWords * lanes;
  for (int64_t k = 0; k < n / per_block; ++k) {
    __m512i lower_sums = _mm512_setzero_si512(), upper_sums = _mm512_setzero_si512();
    for (int64_t l = 0; l < lanes; ++l) {
      const __m128i shift = _mm_cvtsi64_si128(l * width);
      const int64_t i = k * per_block + l * kBlockWords;
      const __m512 v = _mm512_loadu_ps(x + i), a = _mm512_abs_ps(v);
      if (kStats) {
        const __mmask16 finite = _mm512_cmp_ps_mask(a, largest, _CMP_LE_OQ);  // false for NaN and infinity
        all_finite &= finite;
        highs = _mm512_mask_max_ps(highs, finite, highs, a);
      }
      const __m512 level = _mm512_min_ps(  // as _mm256_min_ps: a NaN level becomes the limit
          _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(a, factors), _mm512_loadu_ps(noise + i)),
                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
          limit);
      const __m512i signed_level =
          _mm512_or_si512(_mm512_castps_si512(level), _mm512_and_si512(_mm512_castps_si512(v), sign));
      const __m512i lane = _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_castsi512_ps(signed_level)), offset);
      const __m512i lower = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(lane));       // values i .. i + 7
      const __m512i upper = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(lane, 1));  // i + 8 .. i + 15
      lower_sums = _mm512_add_epi64(lower_sums, _mm512_sll_epi64(lower, shift));
      upper_sums = _mm512_add_epi64(upper_sums, _mm512_sll_epi64(upper, shift));
    }
    store_8_words(lower_sums, float_words, words + k * kBlockWords);
    store_8_words(upper_sums, float_words, words + k * kBlockWords + 8);
  }
  if (kStats) *high = std::max(*high, _mm512_reduce_max_ps(highs));
  return all_finite != 0xFFFF;
}
#endif

// The encode of one group's whole lane blocks (encode_one_group_avx2's contract) at this CPU's widest vectors.
template <bool kStats>
inline bool encode_one_group(const float* x, const float* noise, int64_t n, float factor, int64_t coarse,
                             int64_t lanes, int64_t width, bool float_words, int64_t* words, float* high) {
#if defined(__AVX512F__)
  return encode_one_group_avx512<kStats>(x, noise, n, factor, coarse, lanes, width, float_words, words, high);
#else
  return encode_one_group_avx2<kStats>(x, noise, n, factor, coarse, lanes, width, float_words, words, high);
#endif
}

// The 16 means of one lane of a block of 16 words of +1 counts over `group` workers: (2 count - group) / group.
inline void counts_lane_avx2(const int64_t* words, int64_t shift, int64_t mask, int64_t group, bool stream,
                             float* out) {
  const __m128i count = _mm_cvtsi64_si128(shift);
  const __m256i masks = _mm256_set1_epi64x(mask), groups = _mm256_set1_epi32(static_cast<int>(group));
  const __m256 divisor = _mm256_set1_ps(static_cast<float>(group));
  for (int j = 0; j < kBlockWords; j += 8) {
    const __m256i counts = lanes_of_8_words(words + j, count, masks);
    const __m256i signed_sums = _mm256_sub_epi32(_mm256_add_epi32(counts, counts), groups);
    store_means8(out + j, _mm256_div_ps(_mm256_cvtepi32_ps(signed_sums), divisor), stream);
  }
}
#endif

// words[0 .. n / L) <- the n lane values (whole lane blocks) in the blocked order (packing.pack_lane_blocks): lane
// l of word B k + j holds value L B k + B l + j, shifted left by l * width; with float_words, each word as the float64
// of its value (below 2**52: lanes * width <= 52).
void pack_lane_blocks(const int32_t* values, int64_t n, int64_t lanes, int64_t width, int64_t* words,
                      bool float_words = false) {
  const int64_t per_block = kBlockWords * lanes;
  for (int64_t k = 0; k < n / per_block; ++k) {
    const int32_t* v = values + k * per_block;
#if defined(__AVX2__)
    __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t l = 0; l < lanes; ++l) {
      const __m128i shift = _mm_cvtsi64_si128(l * width);
      for (int q = 0; q < 4; ++q) {  // words 4 q .. 4 q + 3 of the block: values B l + 4 q .. B l + 4 q + 3
        const __m128i lane = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + l * kBlockWords + 4 * q));
        sums[q] = _mm256_add_epi64(sums[q], _mm256_sll_epi64(_mm256_cvtepi32_epi64(lane), shift));
      }
    }
    for (int q = 0; q < 4; ++q) store_4_words(sums[q], float_words, words + k * kBlockWords + 4 * q);
#else
    int64_t sum[kBlockWords];
    for (int64_t j = 0; j < kBlockWords; ++j) sum[j] = v[j];
    for (int64_t l = 1; l < lanes; ++l)
      for (int64_t j = 0; j < kBlockWords; ++j) sum[j] += static_cast<int64_t>(v[l * kBlockWords + j]) << (l * width);
    if (float_words) {
      double exact[kBlockWords];
      for (int64_t j = 0; j < kBlockWords; ++j) exact[j] = static_cast<double>(sum[j]);
      std::memcpy(words + k * kBlockWords, exact, sizeof(exact));
    } else {
      std::memcpy(words + k * kBlockWords, sum, sizeof(sum));
    }
#endif
  }
}

// The scale group that holds all of values [start, start + n) (ends cumulative, as fill_factors), else -1.
int64_t one_group(const int64_t* ends, int64_t groups, int64_t start, int64_t n) {
  const int64_t g = std::upper_bound(ends, ends + groups, start) - ends;
  return g < groups && start + n <= ends[g] ? g : -1;
}

int64_t chunk_values(int64_t lanes) { return std::max<int64_t>(1, kChunk / (kBlockWords * lanes)) * kBlockWords * lanes; }

// kByteBits[p]: the 8 bits of byte p, least significant first, one per byte (0 or 1).
const struct ByteBits {
  uint64_t spread[256];
  ByteBits() {
    for (int p = 0; p < 256; ++p) {
      spread[p] = 0;
      for (int j = 0; j < 8; ++j) spread[p] |= static_cast<uint64_t>((p >> j) & 1) << (8 * j);
    }
  }
  const uint64_t& operator[](uint8_t p) const { return spread[p]; }
} kByteBits;

// Birder's moments of values [start, start + n) inside the runs from r on (hvdcomp_draw_bits says how); returns the
// first run that may reach values past start + n.
inline int64_t update_moments(float* m, float* b, const float* grad, const int64_t* bounds, const float* betas,
                              int64_t runs, int64_t r, int64_t start, int64_t n) {
  for (; r < runs && bounds[2 * r + 1] <= start; ++r) {
  }
  for (int64_t q = r; q < runs && bounds[2 * q] < start + n; ++q) {
    const int64_t lo = std::max(bounds[2 * q], start), hi = std::min(bounds[2 * q + 1], start + n);
    const float beta = betas[2 * q], rest = betas[2 * q + 1];
    for (int64_t i = lo; i < hi; ++i) {
      m[i] = m[i] * beta + grad[i] * rest;
      b[i] = b[i] * beta + std::fabs(grad[i]) * rest;
    }
  }
  return r;
}

// Birder's bits of n values from their uniforms: (v b < m) | (b == 0 & v < 0), v = 2 U - 1.
template <typename Bit>
inline void draw_tile(const float* m, const float* b, const float* noise, int64_t n, Bit* bits) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = noise[i] * 2.0f - 1.0f;
    bits[i] = (v * b[i] < m[i]) | ((b[i] == 0.0f) & (v < 0.0f));
  }
}

// Each entry point returns 0, or kBadArgument without touching memory when its sizes cannot be right (the Python
// wrappers check the tensors' sizes; these checks guard the arithmetic on them).
constexpr int64_t kBadArgument = -1;

constexpr int64_t kFloatWordBits = 52;  // float words: store_4_words's conversion is exact below 2**52

inline bool lanes_fit(int64_t lanes, int64_t width) { return lanes >= 1 && width >= 1 && width <= 63 && lanes * width <= 64; }

inline bool whole_blocks(int64_t first, int64_t last, int64_t lanes) {
  return 0 <= first && first <= last && first % (kBlockWords * lanes) == 0 && last % (kBlockWords * lanes) == 0;
}

}  // namespace

extern "C" {

// The uniforms of elements first .. first + n - 1 of the rounding stream (first and n multiples of 8) into u[0..n)
// (random.uniform).
int64_t hvdcomp_uniform(const int64_t* stream_words, int64_t first, int64_t n, float* u) {
  if (first < 0 || n < 0 || first % 8 || n % 8) return kBadArgument;
  const Stream s{static_cast<uint32_t>(stream_words[0]), static_cast<uint32_t>(stream_words[1]),
                 static_cast<uint32_t>(stream_words[2]), static_cast<uint32_t>(stream_words[3])};
  draw(first, n, s, u);
  return 0;
}

// Words of values [first, last) of the pieces (x: numel values, as Pieces holds them, with its addend; whole lane
// blocks; values past numel are lane value 0) into out[first / L ..):
// value i's lane holds sign(x_i) min(floor(|x_i| f_i + U_i), coarse) + coarse, f_i its group's coarse / M and
// U_i the rounding stream's uniform i (quantize._encode_blocks_eager and _tail_levels_eager). With stats (not null,
// groups + 1 floats), in the same pass: stats[g] <- max(stats[g], the finite |x_i| of group g among those values),
// and stats[groups] <- 1 where one of them is NaN or infinite (quantize.local_stats). With float_words (nonzero; words
// of at most 52 bits) each word is written as the float64 of its value, for a float carrier (hvdcomp/codec/carrier.py).
int64_t hvdcomp_encode(const float* const* pieces, const int64_t* piece_ends, int64_t piece_count, int64_t numel,
                       const int64_t* added_at, const float* added, int64_t added_count, const int64_t* ends,
                       const float* group_factors, int64_t groups, int64_t coarse, int64_t lanes, int64_t width,
                       const int64_t* stream_words, int64_t first, int64_t last, int64_t* out, float* stats,
                       int64_t float_words) {
  const Pieces x{pieces, piece_ends, piece_count, added_at, added, added_count};
  if (numel < 0 || piece_count < 0 || !x.fit(numel) || groups < 0 || coarse < 0 || !lanes_fit(lanes, width) ||
      !whole_blocks(first, last, lanes) || (float_words && lanes * width > kFloatWordBits)) return kBadArgument;
  const int64_t chunk = chunk_values(lanes);
  const float limit = static_cast<float>(coarse);
  const int32_t offset = static_cast<int32_t>(coarse);
  alignas(32) float noise[kChunk + 64], factors[kChunk], padded[kChunk];
  alignas(32) int32_t values[kChunk];
  for (int64_t start = first; start < last; start += chunk) {
    const int64_t n = std::min(chunk, last - start), valid = std::max<int64_t>(0, std::min(n, numel - start));
    const float* xs = x.span(start, valid, padded);  // the last, partial lane block: no further than numel
    hvdcomp_uniform(stream_words, start, n, noise);
#if defined(__AVX2__)
    // a whole chunk of one group (most of them): one pass, no per-value factors (docs/benchmarks.md#the-encode-kernel)
    const int64_t g = valid == n ? one_group(ends, groups, start, n) : -1;
    if (g >= 0) {
      int64_t* words = out + start / lanes;
      const bool bad = stats == nullptr
          ? encode_one_group<false>(xs, noise, n, group_factors[g], coarse, lanes, width, float_words, words, nullptr)
          : encode_one_group<true>(xs, noise, n, group_factors[g], coarse, lanes, width, float_words, words,
                                   stats + g);
      if (bad) stats[groups] = 1.0f;
      continue;
    }
#endif
    fill_factors(start, valid, ends, group_factors, groups, factors);
    if (stats != nullptr && group_maxima(xs, start, valid, ends, groups, stats)) stats[groups] = 1.0f;
    for (int64_t i = 0; i < valid; ++i) {
      float level = std::floor(std::fabs(xs[i]) * factors[i] + noise[i]);
      level = level < limit ? level : limit;
      values[i] = static_cast<int32_t>(std::copysign(level, xs[i])) + offset;
    }
    std::fill(values + valid, values + n, 0);
    pack_lane_blocks(values, n, lanes, width, out + start / lanes, float_words);
  }
  return 0;
}

// Means of values [first, last) (whole lane blocks) from summed words into means[first ..), none at or past limit:
// (lane - offset) f_i, f_i its group's M / (s W), 0 past the last group (quantize._decode_mean_eager).
int64_t hvdcomp_decode(const int64_t* word_sums, const int64_t* ends, const float* group_factors, int64_t groups,
                    int64_t lanes, int64_t width, int64_t offset, int64_t first, int64_t last, int64_t limit,
                    float* means) {
  if (groups < 0 || limit < 0 || !lanes_fit(lanes, width) || !whole_blocks(first, last, lanes)) return kBadArgument;
  const int64_t per_block = kBlockWords * lanes, chunk = chunk_values(lanes), mask = (int64_t{1} << width) - 1;
  const bool narrow = width < 31;  // lane values and offset fit int32: the conversion vectorizes
  const bool stream = std::min(last, limit) - first >= kStreamValues;
  alignas(32) float factors[kChunk], spill[kBlockWords * 64];  // spill: the block that limit cuts
  for (int64_t start = first; start < std::min(last, limit); start += chunk) {
    const int64_t n = std::min(chunk, last - start);
    const int64_t g = one_group(ends, groups, start, n);  // one factor for the whole chunk (most of them)
    if (g < 0) fill_factors(start, n, ends, group_factors, groups, factors);
    const int64_t* words = word_sums + start / lanes;
    for (int64_t k = 0; k < n / per_block && start + k * per_block < limit; ++k) {
      const int64_t at = start + k * per_block, kept = std::min(per_block, limit - at);
      float* out = kept == per_block ? means + at : spill;
      const int64_t* w = words + k * kBlockWords;
      const float* f = factors + k * per_block;
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t i = l * kBlockWords;
        if (narrow) {
#if defined(__AVX2__)
          if (g >= 0) {
            decode_lane_avx2<true>(w, l * width, mask, offset, group_factors + g, stream && out != spill, out + i);
          } else {
            decode_lane_avx2<false>(w, l * width, mask, offset, f + i, stream && out != spill, out + i);
          }
#else
          for (int64_t j = 0; j < kBlockWords; ++j)
            out[i + j] = static_cast<float>(static_cast<int32_t>((w[j] >> (l * width)) & mask) -
                                            static_cast<int32_t>(offset)) * (g >= 0 ? group_factors[g] : f[i + j]);
#endif
        } else {
          for (int64_t j = 0; j < kBlockWords; ++j)
            out[i + j] = static_cast<float>(((w[j] >> (l * width)) & mask) - offset) *
                         (g >= 0 ? group_factors[g] : f[i + j]);
        }
      }
      if (out == spill) std::copy(spill, spill + kept, means + at);
    }
  }
  end_streaming(stream);
  return 0;
}

// Birder's moments and draw (onebit._update_moments_eager, then onebit._draw_lane_blocks_eager and its tail): for
// values [first, last) (whole lane blocks), value i inside run r (spans [bounds[2 r], bounds[2 r + 1]) of [0, numel),
// ascending; betas[2 r], betas[2 r + 1] = beta, 1 - beta as float32) first updates m_i <- beta m_i + (1 - beta) g_i,
// b_i <- beta b_i + (1 - beta) |g_i|; then value i is the bit (v b_i < m_i) | (b_i == 0 & v < 0), v = 2 U - 1 for U
// the stream's uniform draw_first + i (0 past numel), packed into out[first / L ..]. Both in one pass per chunk.
int64_t hvdcomp_draw_bits(float* m, float* b, const float* grad, int64_t numel, const int64_t* bounds,
                       const float* betas, int64_t runs, int64_t lanes, int64_t width, const int64_t* stream_words,
                       int64_t draw_first, int64_t first, int64_t last, int64_t* out) {
  if (numel < 0 || runs < 0 || draw_first < 0 || draw_first % 8 || !lanes_fit(lanes, width) ||
      !whole_blocks(first, last, lanes)) return kBadArgument;
  const int64_t chunk = chunk_values(lanes);
  alignas(32) float noise[kChunk + 64];
  alignas(32) int32_t bits[kChunk];
  int64_t r = 0;
  for (int64_t start = first; start < last; start += chunk) {
    const int64_t n = std::min(chunk, last - start), valid = std::max<int64_t>(0, std::min(n, numel - start));
    r = update_moments(m, b, grad, bounds, betas, runs, r, start, valid);
    hvdcomp_uniform(stream_words, draw_first + start, n, noise);
    draw_tile(m + start, b + start, noise, valid, bits);
    std::fill(bits + valid, bits + n, 0);
    pack_lane_blocks(bits, n, lanes, width, out + start / lanes);
  }
  return 0;
}

// The same moments and bits for values [first, last) of [0, numel) (first a multiple of 8), one uint8 0 / 1 per value
// into out[first ..] (onebit._draw_eager).
int64_t hvdcomp_draw_bools(float* m, float* b, const float* grad, int64_t numel, const int64_t* bounds,
                        const float* betas, int64_t runs, const int64_t* stream_words, int64_t draw_first,
                        int64_t first, int64_t last, uint8_t* out) {
  if (numel < 0 || runs < 0 || draw_first < 0 || draw_first % 8 || first < 0 || first % 8 || first > last ||
      last > numel) return kBadArgument;
  alignas(32) float noise[kChunk + 64];
  int64_t r = 0;
  for (int64_t start = first; start < last; start += kChunk) {
    const int64_t n = std::min(kChunk, last - start);
    r = update_moments(m, b, grad, bounds, betas, runs, r, start, n);
    hvdcomp_uniform(stream_words, draw_first + start, (n + 7) / 8 * 8, noise);
    draw_tile(m + start, b + start, noise, n, out + start);
  }
  return 0;
}

// Bits of values [first, last) (first a multiple of 8): value i is 1 when the stream's uniform draw_first + i is below
// counts[i] / group (float32) for i below `valid`, 0 from there on (counts of +1s among `group` values re-binarized:
// onebit.binarize_counts), one uint8 0 / 1 per value into out[first ..].
int64_t hvdcomp_binarize_counts(const int64_t* counts, int64_t valid, int64_t group, const int64_t* stream_words,
                             int64_t draw_first, int64_t first, int64_t last, uint8_t* out) {
  if (valid < 0 || draw_first < 0 || draw_first % 8 || first < 0 || first % 8 || first > last) return kBadArgument;
  alignas(32) float noise[kChunk + 64];
  const float divisor = static_cast<float>(group);
  for (int64_t start = first; start < last; start += kChunk) {
    const int64_t n = std::min(kChunk, last - start), m = std::max<int64_t>(0, std::min(n, valid - start));
    hvdcomp_uniform(stream_words, draw_first + start, (n + 7) / 8 * 8, noise);
    for (int64_t i = 0; i < m; ++i) out[start + i] = noise[i] < static_cast<float>(counts[start + i]) / divisor;
    std::fill(out + start + m, out + start + n, 0);
  }
  return 0;
}

// Rows of n uint8 0 / 1 values into rows of ceil(n / 8) bytes, least significant bit first, zeros past n
// (packing.bits_to_bytes).
int64_t hvdcomp_pack_bits(const uint8_t* bits, int64_t rows, int64_t n, uint8_t* out) {
  if (rows < 0 || n < 0) return kBadArgument;
  const int64_t bytes = (n + 7) / 8;
  for (int64_t row = 0; row < rows; ++row) {
    const uint8_t* v = bits + row * n;
    uint8_t* o = out + row * bytes;
    for (int64_t k = 0; k < n / 8; ++k) {
      uint64_t word;
      std::memcpy(&word, v + 8 * k, 8);
      o[k] = static_cast<uint8_t>(((word & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
    }
    if (n % 8) {
      uint8_t last = 0;
      for (int64_t j = 0; j < n % 8; ++j) last |= static_cast<uint8_t>((v[n / 8 * 8 + j] & 1) << j);
      o[n / 8] = last;
    }
  }
  return 0;
}

// Rows of `bytes` bytes into rows of n uint8 0 / 1 values (n <= 8 bytes; packing.bytes_to_bits).
int64_t hvdcomp_unpack_bits(const uint8_t* packed, int64_t rows, int64_t bytes, int64_t n, uint8_t* out) {
  if (rows < 0 || n < 0 || bytes * 8 < n) return kBadArgument;
  for (int64_t row = 0; row < rows; ++row) {
    const uint8_t* p = packed + row * bytes;
    uint8_t* o = out + row * n;
    for (int64_t k = 0; k < n / 8; ++k) std::memcpy(o + 8 * k, &kByteBits[p[k]], 8);
    for (int64_t j = n / 8 * 8; j < n; ++j) o[j] = (p[j / 8] >> (j % 8)) & 1;
  }
  return 0;
}

// Words of consecutive lanes (LaneLayout.pack without offset): word w <- the sum over l < L of values[w L + l] << (l
// width), for the n int64 values (non-negative, below 2**width; the last word's missing lanes 0).
int64_t hvdcomp_pack_lanes(const int64_t* values, int64_t n, int64_t lanes, int64_t width, int64_t* words) {
  if (n < 0 || !lanes_fit(lanes, width)) return kBadArgument;
  for (int64_t w = 0; w < (n + lanes - 1) / lanes; ++w) {
    const int64_t count = std::min(lanes, n - w * lanes);
    int64_t word = 0;
    for (int64_t l = 0; l < count; ++l) word += values[w * lanes + l] << (l * width);
    words[w] = word;
  }
  return 0;
}

// The n lane values of words of consecutive lanes (LaneLayout.unpack without offset): values[i] <- (words[i / L] >>
// (i % L) width) & mask.
int64_t hvdcomp_unpack_lanes(const int64_t* words, int64_t n, int64_t lanes, int64_t width, int64_t* values) {
  if (n < 0 || !lanes_fit(lanes, width)) return kBadArgument;
  const int64_t mask = (int64_t{1} << width) - 1;
  for (int64_t w = 0; w < (n + lanes - 1) / lanes; ++w) {
    const int64_t count = std::min(lanes, n - w * lanes), word = words[w];
    for (int64_t l = 0; l < count; ++l) values[w * lanes + l] = (word >> (l * width)) & mask;
  }
  return 0;
}

// means[i] <- (2 c_i - group) / group for the n +1 counts c_i in words of consecutive lanes (onebit.mean_from_counts).
int64_t hvdcomp_lane_counts_mean(const int64_t* words, int64_t n, int64_t lanes, int64_t width, int64_t group,
                              float* means) {
  if (n < 0 || !lanes_fit(lanes, width)) return kBadArgument;
  const int64_t mask = (int64_t{1} << width) - 1;
  const float divisor = static_cast<float>(group);
  for (int64_t w = 0; w < (n + lanes - 1) / lanes; ++w) {
    const int64_t count = std::min(lanes, n - w * lanes), word = words[w];
    for (int64_t l = 0; l < count; ++l)
      means[w * lanes + l] = static_cast<float>(2 * ((word >> (l * width)) & mask) - group) / divisor;
  }
  return 0;
}

// counts[i] <- how many of the rows have bit i set (i < n; rows of `bytes` bytes, least significant bit first).
int64_t hvdcomp_count_bits(const uint8_t* packed, int64_t rows, int64_t bytes, int64_t n, int64_t* counts) {
  if (rows < 0 || n < 0 || bytes * 8 < n) return kBadArgument;
  std::fill(counts, counts + n, 0);
  alignas(32) uint8_t bits[kChunk];
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t m = std::min(kChunk, n - start);
      hvdcomp_unpack_bits(packed + row * bytes + start / 8, 1, (m + 7) / 8, m, bits);
      for (int64_t i = 0; i < m; ++i) counts[start + i] += bits[i];
    }
  return 0;
}

// Means of values [first, last) (whole lane blocks) from summed words of +1 counts over `group` workers into
// means[first ..]: (2 count - group) / group (onebit._mean_from_words_eager).
int64_t hvdcomp_counts_mean(const int64_t* word_sums, int64_t lanes, int64_t width, int64_t group, int64_t first,
                         int64_t last, float* means) {
  if (!lanes_fit(lanes, width) || !whole_blocks(first, last, lanes)) return kBadArgument;
  const int64_t per_block = kBlockWords * lanes, mask = (int64_t{1} << width) - 1;
  const float divisor = static_cast<float>(group);
  const bool stream = last - first >= kStreamValues;
  for (int64_t k = first / per_block; k < last / per_block; ++k)
    for (int64_t l = 0; l < lanes; ++l) {
      const int64_t* w = word_sums + k * kBlockWords;
      float* out = means + k * per_block + l * kBlockWords;
#if defined(__AVX2__)
      if (width < 31) {
        counts_lane_avx2(w, l * width, mask, group, stream, out);
        continue;
      }
#endif
      for (int64_t j = 0; j < kBlockWords; ++j)
        out[j] = static_cast<float>(2 * ((w[j] >> (l * width)) & mask) - group) / divisor;
    }
  end_streaming(stream);
  return 0;
}

// Birder's gradients into its flat buffer, checked in the same pass: sources[k] (an address: sizes[k] float32 values,
// which may be flat + offsets[k] itself) into flat[offsets[k] ..], each span within [0, numel), for the values
// [first, last) of the spans laid end to end; flags[0] <- 1 if some value is NaN or +-Inf, flags[1] <- 1 if some
// value is non-zero where active (one uint8 0 / 1 per element of flat; null: every element is active) is 0
// (onebit.gather_checked).
int64_t hvdcomp_gather_checked(const int64_t* sources, const int64_t* sizes, const int64_t* offsets, int64_t count,
                               float* flat, int64_t numel, const uint8_t* active, int64_t* flags, int64_t first,
                               int64_t last) {
  if (count < 0 || numel < 0 || first < 0 || first > last) return kBadArgument;
  for (int64_t k = 0; k < count; ++k)
    if (sizes[k] < 0 || offsets[k] < 0 || offsets[k] > numel - sizes[k] || (sizes[k] && !sources[k]))
      return kBadArgument;
  uint32_t nonfinite = 0, fresh = 0;
  int64_t at = 0;  // where span k starts in the spans laid end to end
  for (int64_t k = 0; k < count; at += sizes[k], ++k) {
    const float* source = reinterpret_cast<const float*>(sources[k]);
    float* out = flat + offsets[k];
    const uint8_t* on = active ? active + offsets[k] : nullptr;
    const int64_t n = std::min(sizes[k], last - at);
    for (int64_t start = std::max<int64_t>(0, first - at); start < n; start += kChunk) {  // copied while checked
      const int64_t tile = std::min(kChunk, n - start);
      if (source != out) std::memcpy(out + start, source + start, tile * sizeof(float));
      for (int64_t i = start; i < start + tile; ++i) {
        uint32_t word;
        std::memcpy(&word, out + i, sizeof(word));
        nonfinite |= (word & 0x7f800000u) == 0x7f800000u;
      }
      if (on)
        for (int64_t i = start; i < start + tile; ++i) fresh |= (out[i] != 0.0f) & (on[i] == 0);
    }
  }
  flags[0] = nonfinite != 0;
  flags[1] = fresh != 0;
  return 0;
}

// Birder's update of `count` parameters: p[i] <- p[i] keeps[k] + steps[k] mean[offsets[k] + i] for p the sizes[k]
// float32 values at params[k] (an address), each span of mean within [0, mean_numel), for the values [first, last)
// of the parameters laid end to end; both products rounded, then their sum, as the eager reference
// (onebit.apply_updates).
int64_t hvdcomp_birder_update(const int64_t* params, const int64_t* sizes, const int64_t* offsets, const float* keeps,
                              const float* steps, int64_t count, const float* mean, int64_t mean_numel, int64_t first,
                              int64_t last) {
  if (count < 0 || mean_numel < 0 || first < 0 || first > last) return kBadArgument;
  for (int64_t k = 0; k < count; ++k)
    if (sizes[k] < 0 || offsets[k] < 0 || offsets[k] > mean_numel - sizes[k] || (sizes[k] && !params[k]))
      return kBadArgument;
  int64_t at = 0;  // where parameter k starts in the parameters laid end to end
  for (int64_t k = 0; k < count; at += sizes[k], ++k) {
    float* __restrict p = reinterpret_cast<float*>(params[k]);
    const float* __restrict m = mean + offsets[k];
    const float keep = keeps[k], step = steps[k];
    const int64_t n = std::min(sizes[k], last - at);
    for (int64_t i = std::max<int64_t>(0, first - at); i < n; ++i) {
      const float kept = p[i] * keep, moved = m[i] * step;
      p[i] = kept + moved;
    }
  }
  return 0;
}

}  // extern "C"

// ---- Bit planes: the two-stage exchange's messages (hvdcomp/exchange/two_stage.py, packing.pack_planes) --------
// A row of n values of `width` bits is width planes of ceil(n / 8) bytes; plane k's byte j holds bit k of values
// 8 j .. 8 j + 7, least significant bit first, zero bits past n.

namespace {

constexpr int64_t kMaxPlaneWidth = 24;  // three bytes per value in the transposes below

inline bool planes_fit(int64_t width) { return width >= 1 && width <= kMaxPlaneWidth; }

inline int64_t plane_stride(int64_t n) { return (n + 7) / 8; }

#if !defined(__AVX2__)
// Byte `b` of each of the 8 values v[0..8), value l in byte l of the result.
inline uint64_t byte_of_8(const int32_t* v, int b) {
  uint64_t word = 0;
  for (int l = 0; l < 8; ++l) word |= static_cast<uint64_t>((v[l] >> (8 * b)) & 0xFF) << (8 * l);
  return word;
}
#endif

// Plane bytes of 8 values (each below 2**width): planes[k * stride] <- bit k of v[0..8), k < width.
inline void pack_8_planes(const int32_t* v, int64_t width, int64_t stride, uint8_t* planes) {
#if defined(__AVX2__)
  const __m256i values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  for (int64_t k = 0; k < width; ++k)  // bit k of each value into its sign bit, whose mask is the plane's byte
    planes[k * stride] = static_cast<uint8_t>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_sll_epi32(values, _mm_cvtsi64_si128(31 - k)))));
#else
  uint64_t bytes[3] = {byte_of_8(v, 0), width > 8 ? byte_of_8(v, 1) : 0, width > 16 ? byte_of_8(v, 2) : 0};
  for (int64_t k = 0; k < width; ++k)
    planes[k * stride] = static_cast<uint8_t>(
        (((bytes[k / 8] >> (k % 8)) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
#endif
}

// The 8 values whose bit k planes[k * stride] holds (k < width) into v[0..8).
inline void unpack_8_planes(const uint8_t* planes, int64_t width, int64_t stride, int32_t* v) {
  uint64_t bytes[3] = {0, 0, 0};  // bytes[b]: byte b of each value, value l in byte l
  for (int64_t k = 0; k < width; ++k) bytes[k / 8] |= kByteBits[planes[k * stride]] << (k % 8);
#if defined(__AVX2__)
  __m256i values = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes[0])));
  for (int b = 1; b < 3 && 8 * b < width; ++b)
    values = _mm256_or_si256(values, _mm256_slli_epi32(
                                         _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes[b]))), 8 * b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), values);
#else
  for (int l = 0; l < 8; ++l)
    v[l] = static_cast<int32_t>(((bytes[0] >> (8 * l)) & 0xFF) | (((bytes[1] >> (8 * l)) & 0xFF) << 8) |
                                (((bytes[2] >> (8 * l)) & 0xFF) << 16));
#endif
}

#if defined(__AVX512BW__)
// Byte b of each of the 64 values v[0..64), value l in byte l.
inline __m512i byte_of_64(const int32_t* v, int b) {
  const __m128i shift = _mm_cvtsi32_si128(8 * b);
  const auto quarter = [&](int j) {
    return _mm512_cvtepi32_epi8(_mm512_srl_epi32(_mm512_loadu_si512(v + 16 * j), shift));
  };
  const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(quarter(0)), quarter(1), 1);
  const __m256i high = _mm256_inserti128_si256(_mm256_castsi128_si256(quarter(2)), quarter(3), 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// Blocks of 64 values for the plane loops below (AVX-512): a block's values as four vectors of 16 int32, one byte
// of each value in a vector of 64 bytes, one bit of each in a 64-bit mask (a plane's 8 bytes).
struct PlaneBlocks {
  static constexpr int64_t kValues = 64;
  using V = __m512i;
  using Mask = uint64_t;
  static V zero() { return _mm512_setzero_si512(); }
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static void store(int32_t* p, V v) { _mm512_storeu_si512(p, v); }
  static V bytes_of(const int32_t* v, int b) { return byte_of_64(v, b); }
  static Mask bit_of(V bytes, int bit) {
    return _mm512_test_epi8_mask(bytes, _mm512_set1_epi8(static_cast<char>(1 << bit)));
  }
  static V with_bit(V bytes, Mask plane, int bit) {
    return _mm512_mask_mov_epi8(bytes, plane, _mm512_or_si512(bytes, _mm512_set1_epi8(static_cast<char>(1 << bit))));
  }
  static void widen_into(V bytes, int shift_bits, V* v) {  // v[j] |= the bytes of values 16 j .. as int32 << shift
    const __m128i shift = _mm_cvtsi32_si128(shift_bits);
    const __m128i quarters[4] = {_mm512_castsi512_si128(bytes), _mm512_extracti32x4_epi32(bytes, 1),
                                 _mm512_extracti32x4_epi32(bytes, 2), _mm512_extracti32x4_epi32(bytes, 3)};
    for (int j = 0; j < 4; ++j)
      v[j] = _mm512_or_si512(v[j], _mm512_sll_epi32(_mm512_cvtepu8_epi32(quarters[j]), shift));
  }
};
#elif defined(__AVX2__)
// Byte b of each of the 32 values v[0..32), value l in byte l.
inline __m256i byte_of_32(const int32_t* v, int b) {
  const __m128i shift = _mm_cvtsi32_si128(8 * b);
  const __m256i low_byte = _mm256_set1_epi32(0xFF);
  const auto eighth = [&](int j) {
    return _mm256_and_si256(
        _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 8 * j)), shift), low_byte);
  };
  // the packs interleave the 128-bit lanes: bytes of values 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(eighth(0), eighth(1)),
                                            _mm256_packus_epi32(eighth(2), eighth(3)));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Blocks of 32 values for the plane loops below (AVX2): a block's values as four vectors of 8 int32, one byte of
// each value in a vector of 32 bytes, one bit of each in a 32-bit mask (a plane's 4 bytes).
struct PlaneBlocks {
  static constexpr int64_t kValues = 32;
  using V = __m256i;
  using Mask = uint32_t;
  static V zero() { return _mm256_setzero_si256(); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static void store(int32_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static V bytes_of(const int32_t* v, int b) { return byte_of_32(v, b); }
  static Mask bit_of(V bytes, int bit) {  // the bit to each byte's top (16-bit shifts: none reaches bit 15)
    return static_cast<Mask>(_mm256_movemask_epi8(_mm256_sll_epi16(bytes, _mm_cvtsi32_si128(7 - bit))));
  }
  static V with_bit(V bytes, Mask plane, int bit) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,   // byte l <- the
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);  // plane's byte l / 8
    const __m256i bits = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                          1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m256i spread_plane = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(plane)), spread);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread_plane, bits), bits);  // 0xFF where bit l is set
    return _mm256_or_si256(bytes, _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(1 << bit))));
  }
  static void widen_into(V bytes, int shift_bits, V* v) {  // v[j] |= the bytes of values 8 j .. as int32 << shift
    const __m128i shift = _mm_cvtsi32_si128(shift_bits);
    const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
    const __m128i eighths[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int j = 0; j < 4; ++j)
      v[j] = _mm256_or_si256(v[j], _mm256_sll_epi32(_mm256_cvtepu8_epi32(eighths[j]), shift));
  }
};
#endif

#if defined(__AVX2__)
// Plane bytes of a block of values v[0..kValues) (each below 2**width): planes[k * stride ..] <- bit k of each, k <
// width.
inline void pack_block(const int32_t* v, int64_t width, int64_t stride, uint8_t* planes) {
  for (int b = 0; 8 * b < width; ++b) {
    const PlaneBlocks::V bytes = PlaneBlocks::bytes_of(v, b);
    for (int64_t k = 8 * b; k < std::min<int64_t>(width, 8 * b + 8); ++k) {
      const PlaneBlocks::Mask plane = PlaneBlocks::bit_of(bytes, static_cast<int>(k - 8 * b));
      std::memcpy(planes + k * stride, &plane, sizeof plane);
    }
  }
}

// The block of values whose bit k planes[k * stride ..] hold (k < width), a quarter of them in each v[j].
inline void unpack_block(const uint8_t* planes, int64_t width, int64_t stride, PlaneBlocks::V* v) {
  for (int j = 0; j < 4; ++j) v[j] = PlaneBlocks::zero();
  for (int b = 0; 8 * b < width; ++b) {
    PlaneBlocks::V bytes = PlaneBlocks::zero();  // byte b of each value
    for (int64_t k = 8 * b; k < std::min<int64_t>(width, 8 * b + 8); ++k) {
      PlaneBlocks::Mask plane;
      std::memcpy(&plane, planes + k * stride, sizeof plane);
      bytes = PlaneBlocks::with_bit(bytes, plane, static_cast<int>(k - 8 * b));
    }
    PlaneBlocks::widen_into(bytes, 8 * b, v);
  }
}
#endif

// Planes of values[0..n) (a tile starting at value `at` of its row, at a multiple of 8) into the row's planes.
inline void pack_tile(int32_t* values, int64_t n, int64_t at, int64_t width, int64_t stride, uint8_t* planes) {
  std::fill(values + n, values + (n + 7) / 8 * 8, 0);
  int64_t q = 0;
#if defined(__AVX2__)
  for (; 8 * q + PlaneBlocks::kValues <= n; q += PlaneBlocks::kValues / 8)
    pack_block(values + 8 * q, width, stride, planes + at / 8 + q);
#endif
  for (; q < (n + 7) / 8; ++q) pack_8_planes(values + 8 * q, width, stride, planes + at / 8 + q);
}

// The values [at, at + n) of a row's planes (at a multiple of 8) into values[0..n) (up to 7 more past n).
inline void unpack_tile(const uint8_t* planes, int64_t at, int64_t n, int64_t width, int64_t stride, int32_t* values) {
  int64_t q = 0;
#if defined(__AVX2__)
  for (; 8 * q + PlaneBlocks::kValues <= n; q += PlaneBlocks::kValues / 8) {
    PlaneBlocks::V v[4];
    unpack_block(planes + at / 8 + q, width, stride, v);
    for (int j = 0; j < 4; ++j) PlaneBlocks::store(values + 8 * q + j * PlaneBlocks::kValues / 4, v[j]);
  }
#endif
  for (; q < (n + 7) / 8; ++q) unpack_8_planes(planes + at / 8 + q, width, stride, values + 8 * q);
}

}  // namespace

extern "C" {

// Stage one of the two-stage exchange for rows [row_first, row_last) of the pieces' numel values (x, as Pieces holds
// them): row r holds values r chunk .. (r + 1) chunk - 1,
// value i as sign(x_i) min(floor(|x_i| f_i + U_i), coarse) + coarse (coarse past numel), f_i its group's coarse / M
// and U_i the rounding stream's uniform i (quantize.quantize_levels, two_stage.stage_one_message), in planes at
// out + r row_bytes. With stats (not null, groups + 1 floats), in the same pass: stats[g] <- max(stats[g], the finite
// |x_i| of group g among the rows' values), stats[groups] <- 1 where one of them is NaN or infinite (local_stats).
int64_t hvdcomp_encode_planes(const float* const* pieces, const int64_t* piece_ends, int64_t piece_count,
                              int64_t numel, const int64_t* added_at, const float* added, int64_t added_count,
                              const int64_t* ends, const float* group_factors, int64_t groups,
                              int64_t coarse, int64_t width, const int64_t* stream_words, int64_t chunk,
                              int64_t row_first, int64_t row_last, int64_t row_bytes, uint8_t* out, float* stats) {
  const Pieces x{pieces, piece_ends, piece_count, added_at, added, added_count};
  if (numel < 0 || piece_count < 0 || !x.fit(numel) || groups < 0 || coarse < 0 || !planes_fit(width) ||
      2 * coarse >= (int64_t{1} << width) || chunk < 0 || row_first < 0 || row_first > row_last ||
      row_bytes < width * plane_stride(chunk))
    return kBadArgument;
  const Stream s{static_cast<uint32_t>(stream_words[0]), static_cast<uint32_t>(stream_words[1]),
                 static_cast<uint32_t>(stream_words[2]), static_cast<uint32_t>(stream_words[3])};
  const float limit = static_cast<float>(coarse);
  const int32_t offset = static_cast<int32_t>(coarse);
  const int64_t stride = plane_stride(chunk);
  alignas(32) float noise[kChunk + 64], factors[kChunk], gathered[kChunk];
  alignas(32) int32_t values[kChunk + 8];
  for (int64_t r = row_first; r < row_last; ++r)
    for (int64_t at = 0; at < chunk; at += kChunk) {
      const int64_t n = std::min(kChunk, chunk - at), start = r * chunk + at;
      const int64_t valid = std::max<int64_t>(0, std::min(n, numel - start)), skip = start % 8;
      draw(start - skip, (skip + n + 7) / 8 * 8, s, noise);
      fill_factors(start, valid, ends, group_factors, groups, factors);
      const float* xs = x.span(start, valid, gathered);
      if (stats != nullptr && group_maxima(xs, start, valid, ends, groups, stats)) stats[groups] = 1.0f;
      for (int64_t i = 0; i < valid; ++i) {
        float level = std::floor(std::fabs(xs[i]) * factors[i] + noise[skip + i]);
        level = level < limit ? level : limit;
        values[i] = static_cast<int32_t>(std::copysign(level, xs[i])) + offset;
      }
      std::fill(values + valid, values + n, offset);
      pack_tile(values, n, at, width, stride, out + r * row_bytes);
    }
  return 0;
}

// sums[i] <- the sum over the rows (row r's planes at planes + r row_bytes) of their value i, for values [first, last)
// of the n per row (first a multiple of 8).
int64_t hvdcomp_sum_planes(const uint8_t* planes, int64_t rows, int64_t row_bytes, int64_t width, int64_t n,
                           int64_t first, int64_t last, int32_t* sums) {
  if (rows < 0 || n < 0 || !planes_fit(width) || row_bytes < width * plane_stride(n) || first < 0 || first % 8 ||
      first > last || last > n || rows * ((int64_t{1} << width) - 1) > INT32_MAX)
    return kBadArgument;
  const int64_t stride = plane_stride(n);
  int64_t at = first;
#if defined(__AVX2__)
  for (; at + PlaneBlocks::kValues <= last; at += PlaneBlocks::kValues) {
    PlaneBlocks::V total[4] = {PlaneBlocks::zero(), PlaneBlocks::zero(), PlaneBlocks::zero(), PlaneBlocks::zero()};
    PlaneBlocks::V v[4];
    for (int64_t r = 0; r < rows; ++r) {
      unpack_block(planes + r * row_bytes + at / 8, width, stride, v);
      for (int j = 0; j < 4; ++j) total[j] = PlaneBlocks::add(total[j], v[j]);
    }
    for (int j = 0; j < 4; ++j) PlaneBlocks::store(sums + at + j * PlaneBlocks::kValues / 4, total[j]);
  }
#endif
  for (int64_t q = at / 8; q < (last + 7) / 8; ++q) {
    int32_t total[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
    for (int64_t r = 0; r < rows; ++r) {
      unpack_8_planes(planes + r * row_bytes + q, width, stride, v);
      for (int l = 0; l < 8; ++l) total[l] += v[l];
    }
    const int64_t count = std::min<int64_t>(8, last - 8 * q);
    std::copy(total, total + count, sums + 8 * q);
  }
  return 0;
}

// The owner's re-quantization (two_stage, step 3) of values [first, last) (first a multiple of 8) of its n summed
// levels (sum_planes': non-negative): t_i = (sums_i - total) / total, level sign(t_i) min(floor(|t_i| / scale coarse +
// U_i), coarse) + coarse with U_i the stream's uniform i, into planes of n values. sums_i - total is taken in 32 bits
// (exact for such sums and total below 2**31; wrapping, not undefined, for others), whose conversion to float
// vectorizes where an int64's does not without AVX-512 (docs/benchmarks.md#the-draw-and-the-lane-reads).
int64_t hvdcomp_requantize_planes(const int32_t* sums, int64_t n, int64_t total, int64_t coarse, int64_t width,
                                  float scale, const int64_t* stream_words, int64_t first, int64_t last,
                                  uint8_t* planes) {
  if (n < 0 || total < 1 || total > INT32_MAX || coarse < 0 || !planes_fit(width) ||
      2 * coarse >= (int64_t{1} << width) || first < 0 || first % 8 || first > last || last > n || !(scale > 0.0f))
    return kBadArgument;
  const uint32_t total32 = static_cast<uint32_t>(total);
  const Stream s{static_cast<uint32_t>(stream_words[0]), static_cast<uint32_t>(stream_words[1]),
                 static_cast<uint32_t>(stream_words[2]), static_cast<uint32_t>(stream_words[3])};
  const float limit = static_cast<float>(coarse), divisor = static_cast<float>(total);
  const int32_t offset = static_cast<int32_t>(coarse);
  const int64_t stride = plane_stride(n);
  alignas(32) float noise[kChunk + 64];
  alignas(32) int32_t values[kChunk + 8];
  for (int64_t at = first; at < last; at += kChunk) {
    const int64_t m = std::min(kChunk, last - at);
    draw(at, (m + 7) / 8 * 8, s, noise);
    for (int64_t i = 0; i < m; ++i) {
      const int32_t centred = static_cast<int32_t>(static_cast<uint32_t>(sums[at + i]) - total32);
      const float mean = static_cast<float>(centred) / divisor;
      float level = std::floor(std::fabs(mean) / scale * limit + noise[i]);
      level = level < limit ? level : limit;
      values[i] = static_cast<int32_t>(std::copysign(level, mean)) + offset;
    }
    pack_tile(values, m, at, width, stride, planes);
  }
  return 0;
}

// The two-stage result for rows [row_first, row_last) of the gathered rows (row r's planes at planes + r row_bytes,
// chunk values each): out[r chunk + j] <- ((v - coarse) row_factors[r]) f_i coarse for the value v of j, i = r chunk +
// j < numel, f_i its group's M / coarse (0 past the last group).
int64_t hvdcomp_decode_planes(const uint8_t* planes, int64_t row_bytes, int64_t width, int64_t chunk, int64_t numel,
                              const float* row_factors, const int64_t* ends, const float* group_factors,
                              int64_t groups, int64_t coarse, int64_t row_first, int64_t row_last, float* out) {
  if (numel < 0 || groups < 0 || coarse < 0 || !planes_fit(width) || chunk < 0 || row_first < 0 ||
      row_first > row_last || row_bytes < width * plane_stride(chunk))
    return kBadArgument;
  const int64_t stride = plane_stride(chunk);
  const float levels = static_cast<float>(coarse);
  const int32_t offset = static_cast<int32_t>(coarse);
  const bool stream = std::min(row_last * chunk, numel) - row_first * chunk >= kStreamValues;
  alignas(32) float factors[kChunk];
  alignas(32) int32_t values[kChunk + 8];
  for (int64_t r = row_first; r < row_last; ++r)
    for (int64_t at = 0; at < chunk; at += kChunk) {
      const int64_t start = r * chunk + at, valid = std::max<int64_t>(0, std::min(std::min(kChunk, chunk - at),
                                                                                   numel - start));
      if (valid == 0) break;
      unpack_tile(planes + r * row_bytes, at, valid, width, stride, values);
      fill_factors(start, valid, ends, group_factors, groups, factors);
      const float row_factor = row_factors[r];
      float* means = out + start;
      const auto mean_of = [&](int64_t i) {
        return static_cast<float>(values[i] - offset) * row_factor * factors[i] * levels;
      };
      int64_t i = 0;
#if defined(__AVX2__)
      // one value at a time up to a 32-byte boundary (rows start anywhere), then 8 at a time
      for (; i < valid && (reinterpret_cast<uintptr_t>(means + i) & 31) != 0; ++i) means[i] = mean_of(i);
      const __m256 row_factors8 = _mm256_set1_ps(row_factor), levels8 = _mm256_set1_ps(levels);
      const __m256i offsets = _mm256_set1_epi32(offset);
      for (; i + 8 <= valid; i += 8) {
        const __m256i v = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i)), offsets);
        const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), row_factors8),
                                            _mm256_loadu_ps(factors + i));
        store_means8(means + i, _mm256_mul_ps(scaled, levels8), stream);
      }
#endif
      for (; i < valid; ++i) means[i] = mean_of(i);
    }
  end_streaming(stream);
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// The randomized Hadamard rotation of scale groups (hvdcomp/codec/rotation.py, whose docstring gives the blocks and
// the order of operations; tests/test_rotation.py checks this kernel against it bit for bit).

namespace {

constexpr int64_t kMaxRotationBlock = int64_t{1} << 16;  // rotation.MAX_BLOCK

// x[0..n) *= -1 where uniform `start + i` of the stream is above 1/2 (the rotation's signs).
void flip_signs(float* x, int64_t start, int64_t n, const Stream& s) {
  float u[kChunk + 16];
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min(kChunk, n - done), first = (start + done) & ~int64_t{7};
    const int64_t skip = start + done - first;
    draw(first, (skip + m + 7) & ~int64_t{7}, s, u);
    for (int64_t i = 0; i < m; ++i) x[done + i] = x[done + i] * (u[skip + i] > 0.5f ? -1.0f : 1.0f);
    done += m;
  }
}

// One Hadamard level h of x[0..b): (u, v) -> (u + v, u - v) for x[j], x[j + h] of each run of 2 h.
void hadamard_level(float* x, int64_t b, int64_t h) {
  for (int64_t i = 0; i < b; i += 2 * h)
    for (int64_t j = i; j < i + h; ++j) {
      const float u = x[j], v = x[j + h];
      x[j] = u + v;
      x[j + h] = u - v;
    }
}

// Two Hadamard levels h and 2 h of x[0..b) in one pass (4 h <= b): the same sums and differences as two passes.
void hadamard_two_levels(float* x, int64_t b, int64_t h) {
  for (int64_t i = 0; i < b; i += 4 * h)
    for (int64_t j = i; j < i + h; ++j) {
      const float p = x[j] + x[j + h], q = x[j] - x[j + h], r = x[j + 2 * h] + x[j + 3 * h],
                  t = x[j + 2 * h] - x[j + 3 * h];
      x[j] = p + r;
      x[j + h] = q + t;
      x[j + 2 * h] = p - r;
      x[j + 3 * h] = q - t;
    }
}

#if defined(__AVX2__)
// Levels 1, 2 and 4 of 8 consecutive values in a register: each level's lower half u + v, its upper half u - v.
inline __m256 hadamard8(__m256 x) {
  __m256 swapped = _mm256_permute_ps(x, 0xB1);
  x = _mm256_blend_ps(_mm256_add_ps(x, swapped), _mm256_sub_ps(swapped, x), 0xAA);
  swapped = _mm256_permute_ps(x, 0x4E);
  x = _mm256_blend_ps(_mm256_add_ps(x, swapped), _mm256_sub_ps(swapped, x), 0xCC);
  swapped = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), _MM_SHUFFLE(1, 0, 3, 2)));  // halves swapped
  return _mm256_blend_ps(_mm256_add_ps(x, swapped), _mm256_sub_ps(swapped, x), 0xF0);
}
#endif

// The Hadamard levels h = 1, 2, ..., b / 2 of x[0..b), then the factor b**-1/2 (rounded to float32).
void hadamard_block(float* x, int64_t b) {
  int64_t h = 1;
#if defined(__AVX2__)
  if (b >= 8) {
    for (int64_t i = 0; i < b; i += 8) _mm256_storeu_ps(x + i, hadamard8(_mm256_loadu_ps(x + i)));
    h = 8;
  }
#endif
  for (; 4 * h <= b; h *= 4) hadamard_two_levels(x, b, h);
  if (h < b) hadamard_level(x, b, h);
  const float factor = static_cast<float>(1.0 / std::sqrt(static_cast<double>(b)));
  for (int64_t i = 0; i < b; ++i) x[i] *= factor;
}

// The largest power of two that is at most n (n >= 1) and at most max_block.
inline int64_t block_at(int64_t n, int64_t max_block) {
  int64_t b = 1;
  while (b * 2 <= n && b * 2 <= max_block) b *= 2;
  return b;
}

}  // namespace

extern "C" {

// Rotates (inverse = 0) or rotates back (inverse = 1) in place the blocks of x[0..numel) that start in [first, last):
// the blocks of the scale groups ending before ends[0..groups) (cumulative, ending at numel), max_block a power of
// two in [1, 2**16], the signs from the stream's uniforms of each element's index.
int64_t hvdcomp_rotate(float* x, int64_t numel, const int64_t* ends, int64_t groups, int64_t max_block,
                       const int64_t* stream_words, int64_t inverse, int64_t first, int64_t last) {
  if (numel < 0 || groups < 0 || max_block < 1 || max_block > kMaxRotationBlock || (max_block & (max_block - 1)) ||
      (inverse != 0 && inverse != 1) || first < 0 || first > last || last > numel || (groups == 0 && numel != 0))
    return kBadArgument;
  if (!ends_within(ends, groups, numel) || (groups && ends[groups - 1] != numel)) return kBadArgument;
  const Stream s{static_cast<uint32_t>(stream_words[0]), static_cast<uint32_t>(stream_words[1]),
                 static_cast<uint32_t>(stream_words[2]), static_cast<uint32_t>(stream_words[3])};
  for (int64_t g = std::upper_bound(ends, ends + groups, first) - ends; g < groups; ++g) {
    int64_t pos = g ? ends[g - 1] : 0;
    if (pos >= last) break;
    while (pos < ends[g]) {
      const int64_t b = block_at(ends[g] - pos, max_block);
      if (pos >= first && pos < last) {
        if (!inverse) flip_signs(x + pos, pos, b, s);
        hadamard_block(x + pos, b);
        if (inverse) flip_signs(x + pos, pos, b, s);
      }
      pos += b;
    }
  }
  return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------------
// The 16-bit exchange's mean (hvdcomp/codec/half.py's _mean_eager and _mean_all_finite_eager): 16-bit sums widened to
// float32 exactly, then divided by W, in one pass. tests/test_native_half.py checks it bit for bit.

namespace {

constexpr int64_t kFloat16 = 0, kBFloat16 = 1;  // native_half.py's KINDS

// The float32 value of 16-bit float bits h (IEEE binary16 for kFloat16, the upper half of a float32 for kBFloat16):
// exact, NaN stays NaN.
inline float widen(uint16_t h, int64_t kind) {
  uint32_t bits;
  if (kind == kBFloat16) {
    bits = static_cast<uint32_t>(h) << 16;
  } else {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2**-24, exact in float32
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
      return sign ? -magnitude : magnitude;
    }
    bits = exponent == 0x1F ? sign | 0x7F800000u | (mantissa << 13)  // infinity or NaN
                            : sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace

extern "C" {

// out[i] <- widen(sums[i]) / divisor for i in [first, last) of n (divisor = W >= 1, as float32); with nonfinite not
// null, *nonfinite <- 1 if one of those means is NaN or infinite (never cleared).
int64_t hvdcomp_half_mean(const uint16_t* sums, int64_t n, int64_t kind, float divisor, int64_t first, int64_t last,
                          float* out, uint8_t* nonfinite) {
  if ((kind != kFloat16 && kind != kBFloat16) || !(divisor >= 1.0f) || first < 0 || first > last || last > n)
    return kBadArgument;
  int64_t i = first;
  bool bad = false;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 divisors = _mm256_set1_ps(divisor), sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(FLT_MAX);
  const bool stream = last - first >= kStreamValues;
  int bad_lanes = 0;
  for (; i + 8 <= last; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums + i));
    const __m256 wide = kind == kBFloat16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                          : _mm256_cvtph_ps(h);
    const __m256 mean = _mm256_div_ps(wide, divisors);
    store_means8(out + i, mean, stream);
    bad_lanes |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, mean), largest, _CMP_LE_OQ)) ^ 0xFF;
  }
  end_streaming(stream);
  bad = bad_lanes != 0;
#endif
  for (; i < last; ++i) {
    out[i] = widen(sums[i], kind) / divisor;
    bad |= !(std::fabs(out[i]) <= FLT_MAX);
  }
  if (bad && nonfinite != nullptr) *nonfinite = 1;
  return 0;
}

// The clipped excess (agreed.AgreedScales.clipped) in the groups g of the pieces' numel values (x, as Pieces holds
// them) with check[g] nonzero (group g: values [ends[g - 1], ends[g]), cumulative, within numel): each value above its
// group's limit in magnitude, in ascending order, as its index in indices[k] and x_i - clamp(x_i, -limit, limit) in
// excess[k] for k < capacity; *found <- how many there are, written or not. Each tile of up to kChunk values is read
// where it lies (Pieces::span), and a block of 16 values none of which is above the limit once, no branch each.
int64_t hvdcomp_clip_excess(const float* const* pieces, const int64_t* piece_ends, int64_t piece_count, int64_t numel,
                            const int64_t* added_at, const float* added, int64_t added_count, const int64_t* ends,
                            const float* limits, const uint8_t* check, int64_t groups, int64_t capacity,
                            int64_t* indices, float* excess, int64_t* found) {
  const Pieces x{pieces, piece_ends, piece_count, added_at, added, added_count};
  if (numel < 0 || piece_count < 0 || !x.fit(numel) || groups < 0 || capacity < 0) return kBadArgument;
  if (!ends_within(ends, groups, numel)) return kBadArgument;
  alignas(32) float gathered[kChunk];
  int64_t count = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (!check[g]) continue;
    const float limit = limits[g];
    const int64_t end = ends[g];
    for (int64_t tile = g ? ends[g - 1] : 0; tile < end; tile += kChunk) {
      const int64_t length = std::min(kChunk, end - tile);
      const float* values = x.span(tile, length, gathered);
      for (int64_t at = 0; at < length; at += 16) {
        const int64_t n = std::min<int64_t>(16, length - at);
        const float* xs = values + at;
        if (n == 16) {
          bool any = false;
          for (int64_t j = 0; j < 16; ++j) any |= std::fabs(xs[j]) > limit;
          if (!any) continue;
        }
        for (int64_t j = 0; j < n; ++j) {
          const float v = xs[j];
          if (!(std::fabs(v) > limit)) continue;
          if (count < capacity) {
            indices[count] = tile + at + j;
            excess[count] = v - std::clamp(v, -limit, limit);
          }
          ++count;
        }
      }
    }
  }
  *found = count;
  return 0;
}

// quantize.local_stats of values [first, last) of x (groups: values [ends[g - 1], ends[g]), cumulative, within numel):
// stats[g] <- the max of stats[g] and the finite |x_i| of group g among them, stats[groups] <- 1 where one of them is
// NaN or infinite.
int64_t hvdcomp_local_stats(const float* x, int64_t numel, const int64_t* ends, int64_t groups, int64_t first,
                            int64_t last, float* stats) {
  if (numel < 0 || groups < 0 || first < 0 || first > last || last > numel) return kBadArgument;
  if (!ends_within(ends, groups, numel)) return kBadArgument;
  if (group_maxima(x + first, first, last - first, ends, groups, stats)) stats[groups] = 1.0f;
  return 0;
}

// The exact sums of a reduced float carrier's words (hvdcomp/codec/carrier.py), in place: values[i] (float64, i in
// [first, last) of [0, n)) <- the int64 nearest to values[i] * multiplier, rounding half to even (torch.round): adding
// 2**52 rounds to an integer, whose bits less those of 2**52 are that integer. A result outside [0, 2**51) (no sum
// of carrier words; NaN and infinities land there too) is written as 0 and sets *out_of_range to 1.
int64_t hvdcomp_carrier_sums(double* values, int64_t n, double multiplier, int64_t first, int64_t last,
                             uint8_t* out_of_range) {
  if (!(multiplier >= 1.0 && multiplier <= 4294967296.0) || first < 0 || first > last || last > n)
    return kBadArgument;
  constexpr double kTwo52 = 4503599627370496.0;
  constexpr int64_t kTwo52Bits = 0x4330000000000000, kLimit = int64_t{1} << 51;
  int64_t i = first;
  bool bad = false;
#if defined(__AVX2__)
  const __m256d multipliers = _mm256_set1_pd(multiplier), two52 = _mm256_set1_pd(kTwo52);
  const __m256i bias = _mm256_set1_epi64x(kTwo52Bits), minus_one = _mm256_set1_epi64x(-1),
                limit = _mm256_set1_epi64x(kLimit);
  __m256i inside_all = minus_one;
  for (; i + 4 <= last; i += 4) {
    const __m256d scaled = _mm256_mul_pd(_mm256_loadu_pd(values + i), multipliers);
    const __m256i sums = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(scaled, two52)), bias);  // wraps
    const __m256i inside = _mm256_and_si256(_mm256_cmpgt_epi64(sums, minus_one), _mm256_cmpgt_epi64(limit, sums));
    inside_all = _mm256_and_si256(inside_all, inside);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + i), _mm256_and_si256(inside, sums));
  }
  bad = _mm256_movemask_pd(_mm256_castsi256_pd(inside_all)) != 0xF;
#endif
  for (; i < last; ++i) {
    const double shifted = values[i] * multiplier + kTwo52;
    uint64_t bits;
    std::memcpy(&bits, &shifted, sizeof(bits));
    int64_t sum = static_cast<int64_t>(bits - static_cast<uint64_t>(kTwo52Bits));  // wraps, as the vector loop
    if (!(sum >= 0 && sum < kLimit)) {
      bad = true;
      sum = 0;
    }
    std::memcpy(values + i, &sum, sizeof(sum));
  }
  if (bad && out_of_range != nullptr) *out_of_range = 1;
  return 0;
}

}  // extern "C"
