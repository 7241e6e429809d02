/* Decode attention on CPU, reading the paged KV cache where it lies.
 *
 * One query token per sequence against its whole context: every (sequence, KV head) pair
 * walks its blocks once, scoring the group's query heads against each key and folding the
 * values into a running softmax (block by block), so no context is ever gathered or padded.
 * Built by pdserve/engine/attention/cpu_native.py with the machine's own vector width; the
 * sequences can be shared among torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 512
#define MAX_GROUP 32
#define MAX_BLOCK 512

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

/* One (sequence, KV head): `group` query heads at `q` (already scaled, [group][dim]). */
static void attend_pair(const float *q, int64_t group, int64_t dim, const void *k_cache,
                        const void *v_cache, int is_bf16, const int32_t *blocks,
                        int64_t seq_len, int64_t block_size, int64_t token_stride,
                        int64_t head_offset, float *acc) {
    float scores[MAX_GROUP][MAX_BLOCK];
    float running_max[MAX_GROUP], total[MAX_GROUP];
    float row[MAX_HEAD_DIM];
    for (int64_t j = 0; j < group; j++) {
        running_max[j] = -INFINITY;
        total[j] = 0.0f;
        memset(acc + j * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t start = 0; start < seq_len; start += block_size) {
        int64_t count = seq_len - start < block_size ? seq_len - start : block_size;
        int64_t base = (int64_t)blocks[start / block_size] * block_size * token_stride
                       + head_offset;
        for (int64_t t = 0; t < count; t++) {
            load(k_cache, base + t * token_stride, dim, is_bf16, row);
            for (int64_t j = 0; j < group; j++) {
                const float *qj = q + j * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) {
                    dot += qj[d] * row[d];
                }
                scores[j][t] = dot;
            }
        }
        for (int64_t j = 0; j < group; j++) {
            float block_max = -INFINITY;
            const float *sj = scores[j];
#pragma omp simd reduction(max : block_max)
            for (int64_t t = 0; t < count; t++) {
                block_max = sj[t] > block_max ? sj[t] : block_max;
            }
            if (block_max > running_max[j]) {
                /* exp(-inf) is 0: the first block rescales nothing. */
                float rescale = exp_nonpositive(running_max[j] - block_max);
                total[j] *= rescale;
                float *aj = acc + j * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) {
                    aj[d] *= rescale;
                }
                running_max[j] = block_max;
            }
            float top = running_max[j], sum = 0.0f;
            float *pj = scores[j];
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < count; t++) {
                float p = exp_nonpositive(pj[t] - top);
                pj[t] = p;
                sum += p;
            }
            total[j] += sum;
        }
        for (int64_t t = 0; t < count; t++) {
            load(v_cache, base + t * token_stride, dim, is_bf16, row);
            for (int64_t j = 0; j < group; j++) {
                float p = scores[j][t];
                float *aj = acc + j * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) {
                    aj[d] += p * row[d];
                }
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float inverse = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;
        float *aj = acc + j * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) {
            aj[d] *= inverse;
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
    int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) {
        return -1;
    }
    float q[MAX_GROUP * MAX_HEAD_DIM];
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    int64_t token_stride = num_kv_heads * head_dim;
    for (int64_t i = first; i < last; i++) {
        int64_t seq = seqs[i], row = rows[i];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            for (int64_t j = 0; j < group; j++) {
                int64_t head = h * group + j;
                float *qj = q + j * head_dim;
                load(query, row * q_row_stride + head * q_head_stride, head_dim, is_bf16, qj);
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) {
                    qj[d] *= scale;
                }
            }
            attend_pair(q, group, head_dim, k_cache, v_cache, is_bf16,
                        block_tables + seq * table_stride, seq_lens[seq], block_size,
                        token_stride, h * head_dim, acc);
            for (int64_t j = 0; j < group; j++) {
                int64_t head = h * group + j;
                store(out, row * o_row_stride + head * o_head_stride, head_dim, is_bf16,
                      acc + j * head_dim);
            }
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
