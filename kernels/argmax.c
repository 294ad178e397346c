/* Row-wise argmax of fp32 logits with torch.argmax's rules: the first maximal index; a
 * row holding NaN answers its first NaN. See sampling.py (greedy) for why. */
#include <math.h>
#include <stdint.h>

#include "skinny_block.h"

void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t k = 0; k < cols; k += 16) {
            __mmask16 m = mask_for(cols - k);
            __m512 v = _mm512_maskz_loadu_ps(m, row + k);
            nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            best = _mm512_mask_max_ps(best, m, v, best); /* max(v, best): a NaN v keeps best */
        }
        __m512 target = nan ? _mm512_set1_ps(0.0f) : _mm512_set1_ps(_mm512_reduce_max_ps(best));
        int64_t found = 0;
        for (int64_t k = 0; k < cols; k += 16) {
            __mmask16 m = mask_for(cols - k);
            __m512 v = _mm512_maskz_loadu_ps(m, row + k);
            __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)
                                : _mm512_mask_cmp_ps_mask(m, v, target, _CMP_EQ_OQ);
            if (hit) {
                found = k + __builtin_ctz((unsigned)hit);
                break;
            }
        }
        out[r] = found;
    }
}
