// One query token's attention over a stored document layer plus the appended tokens, on a CPU.
//
// The C++ twin of kernels/decode_attention_ref.py (same arguments, same result up to the rounding of
// reordered sums). The document's keys and values are read once, as they are stored (fp32, fp16 or
// bf16, or 8/4/3-bit group codes with fp16 scales and minimums), and decoded a vector at a time where they
// are used (with AVX-512; otherwise a pass of rows at a time into a tile that stays in L1), so no
// full-precision copy of a coded layer is ever built. Work is split flash-decoding
// style (Dao et al. 2023, https://pytorch.org/blog/flash-decoding/): each (kv head, block of entries)
// keeps a running maximum, sum and output (online softmax), and the blocks are merged by their
// log-sum-exp at the end. Grouped-query aware: each key row is read once for the G query heads that
// share it.
//
// The rows as stored are read through attention_rows.h, the inner sums are in attention_sums.h, the vector
// helpers in cpu_vectors.h. Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension), with
// -march=native; the operator's schema is defined there, in Python, so that TorchScript knows it
// even where no compiler is available.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_q8.h"
#include "attention_rows.h"
#include "attention_sums.h"
#include "attention_values_int.h"
#include "cpu_ops.h"
#include "cpu_vectors.h"

namespace {

using namespace semanticache::cpu;

constexpr int64_t MAX_GROUP = 16;
// at most, one (kv head, block) task: 1 MiB of fp32 keys at D = 64. Each task starts its streams of rows
// again, and from memory fewer, longer tasks are faster: 512 entries against 2048 made 8-bit rows 7-16% slower
// at 4K-7K tokens (4-bit 4-15%, fp32 3-5%; the Kaizen 0.75 int4 step at 4K 3-9%), and 4096 against 2048 (at 7K
// tokens two blocks a head instead of four) made them faster: 8-bit 5.3%, 4-bit 6.4%, fp16 6.2% (30 layers,
// q8 on, one process alternating the builds; at 4K, where both make two blocks a head, within 1.1%)
constexpr int64_t ENTRIES_PER_TASK = 4096;
constexpr int64_t MIN_ENTRIES_PER_TASK = 64;  // at least, where the document is split for the threads

// The running state of one task: per query head the maximum logit, the sum of exp and the output.
struct Partial {
  float* maximum;  // (G)
  float* total;    // (G)
  float* out;      // (G, D)
};

// Online-softmax update of `partial` with entries [begin, end) of `keys`/`values` (one kv head), in
// passes of ENTRIES_PER_PASS: the pass's keys scored for the G query heads, the running maximum and sum, then
// its values added into the G outputs, kept in registers. DECODED: coded or 16-bit rows are decoded a
// vector at a time where they are used (with_rows), each key vector once for KEY_GROUP_BLOCK query heads;
// otherwise (fp32 rows, AVX2) a tile of rows is read (or decoded first) and scored one query head at a
// time. Storing a decoded tile and loading it again for each head made 8-bit rows ~1.4x slower (4K tokens,
// 30 layers: 6.1 -> 4.4 ms); fp32 rows keep the tile loop, which the decoded one slowed by ~10%.
// Q8: coded keys meet the query rounded to Q8_0 (attention_q8.h), in integers where they can; otherwise coded
// keys are scored in integers where they can, the query split into pieces that keep it as it is.
template <int64_t D, bool DECODED>
void attend_rows(const float* query, int64_t group, const Rows& keys, const Rows& values, const float* bias,
                 int64_t head, int64_t begin, int64_t end, Partial partial, bool q8) {
  constexpr int64_t C = D / W, SLICES = ENTRIES_PER_PASS / W;
  alignas(64) float scores[MAX_GROUP][ENTRIES_PER_PASS];
  alignas(64) float tile[ENTRIES_PER_PASS * D];
  alignas(64) float factors[ENTRIES_PER_PASS * D];  // scales and minimums of coded rows (at most D / 2 groups)
  alignas(64) float paired_query[MAX_GROUP * D];
  if (keys.paired) {  // keys decoded in paired order meet a query in that order: the same dot products
    std::copy(query, query + group * D, paired_query);
    pair_channels<D>(paired_query, group, false);
    query = paired_query;
  }
  RoundedQuery<D> rounded;
  const bool rounds = q8 && keys.scales != nullptr;  // coded keys only
  const bool integer = keys.scales != nullptr && integer_scored(keys, D);
  if (rounds) {
    rounded.round(query, group, keys.group_width);
    query = rounded.rounded;
  } else if (integer) {  // the query as it is, in pieces of integers
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    rounded.split(query, group, keys.group_width);
#endif
  }
  const bool weighs = q8 && integer_weighted(values, D);  // coded values in integers (attention_values_int.h)
  IntegerValues<D> integer_values(values, weighs ? group : 0);
  if (values.paired) pair_channels<D>(partial.out, group, false);  // summed in the values' order, put back below
  vf q[MAX_GROUP][C];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < C; ++c) q[g][c] = load(query + g * D + W * c);
  for (int64_t start = begin; start < end; start += ENTRIES_PER_PASS) {
    const int64_t count = std::min(ENTRIES_PER_PASS, end - start), slices = (count + W - 1) / W;
    if (!keys.prefetched_by_row(D)) keys.prefetch_ahead(head, start, begin, end);
    if (!values.prefetched_by_row(D)) values.prefetch_ahead(head, start, begin, end);
    // -- scores of the pass, W rows at a time (padding lanes -inf)
    if (integer) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      integer_pass_scores<D>(rounded, group, keys, head, start, count, bias == nullptr ? nullptr : bias + start, tile,
                             factors, scores);
#endif
    } else if constexpr (DECODED) {  // KEY_GROUP_BLOCK query heads at a time
      with_rows<D>(keys, head, start, count, tile, factors, [&](auto key) {
        constexpr int64_t GB = KEY_GROUP_BLOCK;
        for (int64_t g = 0; g < group; g += GB) {
          const int64_t heads = std::min(GB, group - g);
          for (int64_t s = 0; s < slices; ++s) {
            const int64_t n = std::min<int64_t>(W, count - W * s);
            const float* row_bias = bias == nullptr ? nullptr : bias + start + W * s;
            vf sums[GB];
            if (heads == GB) {
              if (n == W) scores_of_decoded_rows<D, true, GB>(q + g, key, W * s, n, row_bias, sums);
              else scores_of_decoded_rows<D, false, GB>(q + g, key, W * s, n, row_bias, sums);
            } else {  // the last heads, one at a time
              for (int64_t b = 0; b < heads; ++b)
                scores_of_decoded_rows<D, false, 1>(q + g + b, key, W * s, n, row_bias, sums + b);
            }
            for (int64_t b = 0; b < heads; ++b) {
              for (int64_t r = n; r < W; ++r) sums[b][r] = -INFINITY;
              store(scores[g + b] + W * s, sums[b]);
            }
          }
        }
      });
    } else {  // one query head at a time, from a tile
      const float* key = keys.rows<D>(head, start, count, tile, factors);
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t s = 0; s < slices; ++s) {
          const int64_t n = std::min<int64_t>(W, count - W * s);
          const float* row_bias = bias == nullptr ? nullptr : bias + start + W * s;
          vf sums;
          if (g == 0 && keys.streamed(D))  // the first head reads the rows from memory
            sums = n == W ? scores_of_rows<D, true, true>(q[g], key + W * s * D, n, row_bias)
                          : scores_of_rows<D, false, true>(q[g], key + W * s * D, n, row_bias);
          else
            sums = n == W ? scores_of_rows<D, true>(q[g], key + W * s * D, n, row_bias)
                          : scores_of_rows<D, false>(q[g], key + W * s * D, n, row_bias);
          for (int64_t r = n; r < W; ++r) sums[r] = -INFINITY;
          store(scores[g] + W * s, sums);
        }
      }
    }
    // -- new maximum and sum; scores become weights, the outputs so far are rescaled
    float rescale[MAX_GROUP];
    for (int64_t g = 0; g < group; ++g) {
      vf top = splat(partial.maximum[g]);
      for (int64_t s = 0; s < slices; ++s) {
        const vf x = load(scores[g] + W * s);
        top = x > top ? x : top;
      }
      const float maximum = max_lane(top);
      if (maximum == -INFINITY) {  // every entry so far is padding: weights 0, nothing to rescale
        std::fill(scores[g], scores[g] + SLICES * W, 0.0f);
        rescale[g] = 1.0f;
        continue;
      }
      vf total = vf{};
      for (int64_t s = 0; s < slices; ++s) {
        const vf weights = exp_nonpositive(load(scores[g] + W * s) - maximum);
        store(scores[g] + W * s, weights);
        total += weights;
      }
      rescale[g] = exp_nonpositive(partial.maximum[g] - maximum);
      partial.total[g] = partial.total[g] * rescale[g] + sum_lanes(total);
      partial.maximum[g] = maximum;
    }
    // -- weighted values, GROUP_BLOCK query heads and VALUE_BLOCK channel vectors at a time
    const auto add_pass_values = [&](const auto& value) {
      constexpr int64_t CB = std::min(C, VALUE_BLOCK);
      for (int64_t g = 0; g < group; g += GROUP_BLOCK) {
        for (int64_t c = 0; c < C; c += CB) {
          float* out = partial.out + g * D + W * c;
          switch (std::min(GROUP_BLOCK, group - g)) {
            case 1: add_values<D, 1, CB>(value, count, scores + g, rescale + g, out, c); break;
            case 2: add_values<D, 2, CB>(value, count, scores + g, rescale + g, out, c); break;
#if GROUP_BLOCK_SIZE > 3
            case 3: add_values<D, 3, CB>(value, count, scores + g, rescale + g, out, c); break;
            default: add_values<D, 4, CB>(value, count, scores + g, rescale + g, out, c);
#else
            default: add_values<D, 3, CB>(value, count, scores + g, rescale + g, out, c);
#endif
          }
        }
      }
    };
    if (weighs) {
      integer_values.add_pass(head, start, count, scores, rescale, partial.out, tile, factors);
    } else if constexpr (DECODED) {
      with_rows<D>(values, head, start, count, tile, factors, add_pass_values);
    } else {
      const float* rows = values.rows<D>(head, start, count, tile, factors);
      if (values.streamed(D)) add_pass_values(Tile<D, true>{rows});
      else add_pass_values(Tile<D>{rows});
    }
  }
  if (weighs) integer_values.finish(partial.out);
  if (values.paired) pair_channels<D>(partial.out, group, true);
}

template <bool DECODED>
void attend_dim(int64_t dim, const float* query, int64_t group, const Rows& keys, const Rows& values,
                const float* bias, int64_t head, int64_t begin, int64_t end, Partial partial, bool q8) {
  switch (dim) {
    case 16: return attend_rows<16, DECODED>(query, group, keys, values, bias, head, begin, end, partial, q8);
    case 32: return attend_rows<32, DECODED>(query, group, keys, values, bias, head, begin, end, partial, q8);
    case 64: return attend_rows<64, DECODED>(query, group, keys, values, bias, head, begin, end, partial, q8);
    case 128: return attend_rows<128, DECODED>(query, group, keys, values, bias, head, begin, end, partial, q8);
    default: return attend_rows<256, DECODED>(query, group, keys, values, bias, head, begin, end, partial, q8);
  }
}

void attend(int64_t dim, const float* query, int64_t group, const Rows& keys, const Rows& values, const float* bias,
            int64_t head, int64_t begin, int64_t end, Partial partial, bool q8) {
  if (keys.decoded_in_registers() || values.decoded_in_registers())
    return attend_dim<true>(dim, query, group, keys, values, bias, head, begin, end, partial, q8);
  return attend_dim<false>(dim, query, group, keys, values, bias, head, begin, end, partial, q8);
}

}  // namespace

// The tasks of one token's attention: per head, blocks of the document, then one block of appended tokens,
// each with its running state (per query head the maximum, the sum and the output: G * (D + 2) floats).
struct semanticache::AttentionTasks::Plan {
  Rows doc_keys, doc_values, tail_keys, tail_values;
  const float* bias = nullptr;
  int64_t bias_stride = 0, heads = 0, group = 0, dim = 0, length = 0, appended = 0;
  int64_t entries = 0, doc_blocks = 0, blocks = 0, count = 0, width = 0;
  bool q8 = false;  // coded document keys meet the query rounded to Q8_0
  std::vector<float> state;
  std::atomic<int64_t> next{0};
};

semanticache::AttentionTasks::AttentionTasks(int64_t group, int64_t dim, const at::Tensor& keys,
                                             const std::optional<at::Tensor>& key_scales,
                                             const std::optional<at::Tensor>& key_minimums, int64_t key_bits,
                                             const at::Tensor& values, const std::optional<at::Tensor>& value_scales,
                                             const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                                             const std::optional<at::Tensor>& bias, int64_t threads, bool q8)
    : plan(std::make_unique<Plan>()) {
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256,
              "head dim must be 16, 32, 64, 128 or 256, got ", dim);
  TORCH_CHECK(group >= 1 && group <= MAX_GROUP, "1 to ", MAX_GROUP, " query heads per kv head, got ", group);
  const int64_t heads = keys.size(0), length = keys.size(1);
  TORCH_CHECK(values.size(0) == heads && values.size(1) == length,
              "document keys and values must be (H_kv, L, ...) with H_kv = ", heads);
  Plan& p = *plan;
  p.doc_keys = stored_rows(keys, key_scales, key_minimums, key_bits, dim);
  p.doc_values = stored_rows(values, value_scales, value_minimums, value_bits, dim);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == heads &&
                    bias->size(1) == length && bias->stride(1) == 1,
                "bias must be (H_kv, L) float32 with contiguous rows");
    p.bias = bias->data_ptr<float>();
    p.bias_stride = bias->stride(0);
  }
  // At most ENTRIES_PER_TASK entries a block, and at least two blocks for each thread where the document
  // has MIN_ENTRIES_PER_TASK entries for each: a compressed document's 200-500 entries a head in one block
  // each left one of 2 threads with two of 3 heads' blocks (the blocks' bounds depend on the thread
  // count, and so does the rounding of the merged result).
  const int64_t wanted = std::max((length + ENTRIES_PER_TASK - 1) / ENTRIES_PER_TASK, (2 * threads + heads - 1) / heads);
  const int64_t per_head = std::max<int64_t>(1, std::min(wanted, length / MIN_ENTRIES_PER_TASK));
  p.entries = std::max<int64_t>(1, (length + per_head - 1) / per_head);
  p.doc_blocks = (length + p.entries - 1) / p.entries;
  p.blocks = p.doc_blocks + 1;
  p.count = heads * p.blocks;
  p.width = group * (dim + 2);
  p.heads = heads, p.group = group, p.dim = dim, p.length = length, p.q8 = q8;
  p.state.resize(p.count * p.width);
}

void semanticache::AttentionTasks::bind(const at::Tensor& new_keys, const at::Tensor& new_values, int64_t appended) {
  Plan& p = *plan;
  TORCH_CHECK(new_keys.scalar_type() == at::kFloat && new_values.scalar_type() == at::kFloat && new_keys.dim() >= 3 &&
                  new_keys.sizes() == new_values.sizes() && new_keys.size(-3) == p.heads &&
                  new_keys.size(-1) == p.dim && appended >= 0 && appended <= new_keys.size(-2),
              "appended keys and values must be (H_kv, >= ", appended, ", D) float32");
  p.tail_keys = plain_rows(new_keys);
  p.tail_values = plain_rows(new_values);
  p.appended = appended;
  p.next = 0;
}

semanticache::AttentionTasks::AttentionTasks(AttentionTasks&&) noexcept = default;
semanticache::AttentionTasks::~AttentionTasks() = default;

int64_t semanticache::AttentionTasks::tasks() const { return plan->count; }

// Tasks go in turn, the document's blocks first (the appended tokens' are small), so that no thread waits
// while another still has two blocks.
int64_t semanticache::AttentionTasks::next() { return plan->next++; }

void semanticache::AttentionTasks::run(int64_t order, const float* query) {
  const Plan& p = *plan;
  const int64_t head = order < p.heads * p.doc_blocks ? order / p.doc_blocks : order - p.heads * p.doc_blocks;
  const int64_t block = order < p.heads * p.doc_blocks ? order % p.doc_blocks : p.doc_blocks;
  float* base = plan->state.data() + (head * p.blocks + block) * p.width;
  Partial partial{base, base + p.group, base + 2 * p.group};
  std::fill(partial.maximum, partial.maximum + p.group, -INFINITY);
  std::fill(partial.total, partial.total + p.group * (p.dim + 1), 0.0f);
  const float* head_query = query + head * p.group * p.dim;
  if (block < p.doc_blocks) {
    const int64_t begin = block * p.entries, end = std::min(p.length, begin + p.entries);
    const float* head_bias = p.bias == nullptr ? nullptr : p.bias + head * p.bias_stride;
    attend(p.dim, head_query, p.group, p.doc_keys, p.doc_values, head_bias, head, begin, end, partial, p.q8);
  } else {
    attend(p.dim, head_query, p.group, p.tail_keys, p.tail_values, nullptr, head, 0, p.appended, partial, false);
  }
}

// -- merge the blocks of each head by their log-sum-exp, into out (H_kv, G, D)
void semanticache::AttentionTasks::merge(float* out) const {
  const Plan& p = *plan;
  const int64_t group = p.group, dim = p.dim, blocks = p.blocks, width = p.width;
  std::fill(out, out + p.heads * group * dim, 0.0f);
  for (int64_t head = 0; head < p.heads; ++head) {
    for (int64_t g = 0; g < group; ++g) {
      float top = -INFINITY;
      for (int64_t b = 0; b < blocks; ++b) top = std::max(top, p.state[(head * blocks + b) * width + g]);
      float total = 0.0f;
      float* target = out + (head * group + g) * dim;
      for (int64_t b = 0; b < blocks; ++b) {
        const float* base = p.state.data() + (head * blocks + b) * width;
        if (base[g] == -INFINITY) continue;
        const float weight = std::exp(base[g] - top);
        total += weight * base[group + g];
        const float* part = base + 2 * group + g * dim;
        for (int64_t d = 0; d < dim; ++d) target[d] += weight * part[d];
      }
      for (int64_t d = 0; d < dim; ++d) target[d] /= total;
    }
  }
}

at::Tensor semanticache::decode_attention(const at::Tensor& query, const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                            const std::optional<at::Tensor>& key_minimums, int64_t key_bits, const at::Tensor& values,
                            const std::optional<at::Tensor>& value_scales,
                            const std::optional<at::Tensor>& value_minimums, int64_t value_bits,
                            const std::optional<at::Tensor>& bias, const at::Tensor& new_keys,
                            const at::Tensor& new_values, bool q8_query) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 &&
                  query.is_contiguous(),
              "query must be a contiguous (H_kv, G, D) float32 CPU tensor, got ", query.sizes());
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == query.size(0), "document keys must be (H_kv, L, ...) with H_kv = ",
              query.size(0));
  const int64_t threads = at::get_num_threads();
  AttentionTasks attention(query.size(1), query.size(2), keys, key_scales, key_minimums, key_bits, values, value_scales,
                           value_minimums, value_bits, bias, threads, q8_query);
  attention.bind(new_keys, new_values, new_keys.size(1));
  const float* q = query.data_ptr<float>();
  at::parallel_for(0, std::min(threads, attention.tasks()), 1, [&](int64_t, int64_t) {
    for (int64_t task = attention.next(); task < attention.tasks(); task = attention.next()) attention.run(task, q);
  });
  at::Tensor out = at::empty_like(query);
  attention.merge(out.data_ptr<float>());
  return out;
}


TORCH_LIBRARY_IMPL(semanticache, CPU, m) { m.impl("decode_attention", &semanticache::decode_attention); }
