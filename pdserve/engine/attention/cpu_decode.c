/* Decode attention on CPU, reading the paged KV cache where it lies.
 *
 * One query token per sequence against its whole context: each sequence walks its blocks once,
 * reading all of a block's KV heads together, scoring each head's query group against each key
 * and folding the values into a running softmax (block by block), so no context is ever
 * gathered or padded.
 * Built by pdserve/engine/attention/cpu_native.py with the machine's own vector width; the
 * sequences can be shared among torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 512
#define MAX_HEADS 64
#define MAX_QUERY_FLOATS 16384 /* heads x head_dim */
#define MAX_BLOCK 128

static inline float bf16_value(uint16_t bits) {
    uint32_t word = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

static inline uint16_t bf16_bits(float value) {
    uint32_t word;
    memcpy(&word, &value, sizeof word);
    if ((word & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0; /* NaN stays NaN */
    }
    word += 0x7fffu + ((word >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(word >> 16);
}

/* exp(x) for x <= 0, written so the compiler vectorizes it (libm's expf is one call per
 * value): x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 series (Cephes'
 * coefficients, relative error below 2e-7), times 2^k. 0 below -87 (past float's range),
 * -inf included. */
static inline float exp_nonpositive(float x) {
    float clamped = x < -87.0f ? -87.0f : x;
    float k = floorf(clamped * 1.44269504088896341f + 0.5f);
    float r = clamped - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* `count` values at `base[offset]` as float32. */
static inline void load(const void *base, int64_t offset, int64_t count, int is_bf16,
                        float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < count; d++) {
            dst[d] = bf16_value(src[d]);
        }
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)count * sizeof(float));
    }
}

static inline void store(void *base, int64_t offset, int64_t count, int is_bf16,
                         const float *src) {
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t d = 0; d < count; d++) {
            dst[d] = bf16_bits(src[d]);
        }
    } else {
        memcpy((float *)base + offset, src, (size_t)count * sizeof(float));
    }
}

/* One sequence, every head: each block read once, all its KV heads together. */
static void attend_seq(const float *q, int64_t heads, int64_t kv_heads, int64_t dim,
                       const void *k_cache, const void *v_cache, int is_bf16,
                       const int32_t *blocks, int64_t seq_len, int64_t block_size,
                       float *acc) {
    float scores[MAX_HEADS][MAX_BLOCK];
    float running_max[MAX_HEADS], total[MAX_HEADS];
    float row[MAX_HEAD_DIM];
    int64_t group = heads / kv_heads, token_stride = kv_heads * dim;
    for (int64_t i = 0; i < heads; i++) {
        running_max[i] = -INFINITY;
        total[i] = 0.0f;
        memset(acc + i * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t start = 0; start < seq_len; start += block_size) {
        int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
        int64_t base = (int64_t)blocks[start / block_size] * block_size * token_stride;
        for (int64_t t = 0; t < count; t++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                load(k_cache, base + t * token_stride + h * dim, dim, is_bf16, row);
                for (int64_t j = 0; j < group; j++) {
                    const float *qj = q + (h * group + j) * dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < dim; d++) {
                        dot += qj[d] * row[d];
                    }
                    scores[h * group + j][t] = dot;
                }
            }
        }
        for (int64_t i = 0; i < heads; i++) {
            float block_max = -INFINITY;
            const float *si = scores[i];
#pragma omp simd reduction(max : block_max)
            for (int64_t t = 0; t < count; t++) {
                block_max = si[t] > block_max ? si[t] : block_max;
            }
            if (block_max > running_max[i]) {
                float rescale = exp_nonpositive(running_max[i] - block_max);
                total[i] *= rescale;
                float *ai = acc + i * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) {
                    ai[d] *= rescale;
                }
                running_max[i] = block_max;
            }
            float top = running_max[i], sum = 0.0f;
            float *pi = scores[i];
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < count; t++) {
                float p = exp_nonpositive(pi[t] - top);
                pi[t] = p;
                sum += p;
            }
            total[i] += sum;
        }
        for (int64_t t = 0; t < count; t++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                load(v_cache, base + t * token_stride + h * dim, dim, is_bf16, row);
                for (int64_t j = 0; j < group; j++) {
                    float p = scores[h * group + j][t];
                    float *ai = acc + (h * group + j) * dim;
#pragma omp simd
                    for (int64_t d = 0; d < dim; d++) {
                        ai[d] += p * row[d];
                    }
                }
            }
        }
    }
    for (int64_t i = 0; i < heads; i++) {
        float inverse = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
        float *ai = acc + i * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) {
            ai[d] *= inverse;
        }
    }
}

/* Items [first, last): item i is the sequence at row `seqs[i]` of `block_tables` and
 * `seq_lens`, whose query (and output) is token row `rows[i]`. Strides are in elements.
 * Returns 0, or -1 when a size exceeds the kernel's fixed scratch (the caller checks first). */
int pdserve_decode_attention(const void *query, int64_t q_row_stride, int64_t q_head_stride,
                             const void *k_cache, const void *v_cache,
                             const int32_t *block_tables, int64_t table_stride,
                             const int32_t *seq_lens, const int64_t *seqs, const int64_t *rows,
                             int64_t first, int64_t last, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, int is_bf16, void *out, int64_t o_row_stride,
                             int64_t o_head_stride) {
    if (num_heads > MAX_HEADS || num_heads % num_kv_heads || head_dim > MAX_HEAD_DIM
        || num_heads * head_dim > MAX_QUERY_FLOATS || block_size > MAX_BLOCK) {
        return -1;
    }
    float q[MAX_QUERY_FLOATS];
    float acc[MAX_QUERY_FLOATS];
    for (int64_t i = first; i < last; i++) {
        int64_t seq = seqs[i], row = rows[i];
        for (int64_t head = 0; head < num_heads; head++) {
            float *qh = q + head * head_dim;
            load(query, row * q_row_stride + head * q_head_stride, head_dim, is_bf16, qh);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                qh[d] *= scale;
            }
        }
        attend_seq(q, num_heads, num_kv_heads, head_dim, k_cache, v_cache, is_bf16,
                   block_tables + seq * table_stride, seq_lens[seq], block_size, acc);
        for (int64_t head = 0; head < num_heads; head++) {
            store(out, row * o_row_stride + head * o_head_stride, head_dim, is_bf16,
                  acc + head * head_dim);
        }
    }
    return 0;
}

/* `pdserve_decode_attention` over [0, count), the items shared among `num_threads` of torch's
 * own OpenMP threads (the library links libgomp.so.1, which the process already has from
 * torch): the threads torch's ops keep warm. Each item is computed by one thread in one order,
 * so any split gives the same bits. One thread calls `pdserve_decode_attention` directly. */
int pdserve_decode_attention_shared(const void *query, int64_t q_row_stride,
                                    int64_t q_head_stride, const void *k_cache,
                                    const void *v_cache, const int32_t *block_tables,
                                    int64_t table_stride, const int32_t *seq_lens,
                                    const int64_t *seqs, const int64_t *rows, int64_t first,
                                    int64_t last, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t block_size, float scale,
                                    int is_bf16, void *out, int64_t o_row_stride,
                                    int64_t o_head_stride, int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t i = first; i < last; i++) {
        failed |= pdserve_decode_attention(query, q_row_stride, q_head_stride, k_cache, v_cache,
                                           block_tables, table_stride, seq_lens, seqs, rows, i,
                                           i + 1, num_heads, num_kv_heads, head_dim, block_size,
                                           scale, is_bf16, out, o_row_stride, o_head_stride);
    }
    return failed ? -1 : 0;
}
