/* A grammar's token mask applied to CPU logits: each disallowed token's logit becomes -inf.
 *
 * The bitmask holds one bit per token (1: allowed) in 32-bit words, token t at bit t % 32 of
 * word t / 32, the layout xgrammar fills. Only the listed rows are touched; the bitmask's row
 * i belongs to the logits' row i. Words that allow all or none of their 32 tokens (most of a
 * grammar's mask) take a shortcut; the others select per token, which the compiler vectorizes.
 * Built by pdserve/engine/mask_apply.py.
 */
#include <math.h>
#include <stdint.h>

void pdserve_apply_token_bitmask(float *logits, int64_t logits_row_stride,
                                 const int32_t *bitmask, int64_t bitmask_row_stride,
                                 const int64_t *rows, int64_t num_rows, int64_t vocab) {
    const int64_t whole_words = vocab / 32;
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * logits_row_stride;
        const uint32_t *words = (const uint32_t *)(bitmask + rows[i] * bitmask_row_stride);
        for (int64_t k = 0; k < whole_words; k++) {
            const uint32_t word = words[k];
            float *tokens = row + k * 32;
            if (word == UINT32_MAX) {
                continue;
            }
            if (word == 0) {
                for (int b = 0; b < 32; b++) {
                    tokens[b] = -INFINITY;
                }
                continue;
            }
            for (int b = 0; b < 32; b++) {
                tokens[b] = ((word >> b) & 1u) ? tokens[b] : -INFINITY;
            }
        }
        for (int64_t t = whole_words * 32; t < vocab; t++) {
            if (!((words[t >> 5] >> (t & 31)) & 1u)) {
                row[t] = -INFINITY;
            }
        }
    }
}
