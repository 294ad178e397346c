/* Row-wise argmax of fp32 logits with torch.argmax's rules: the first maximal index; a
 * row holding NaN answers its first NaN. See sampling.py (greedy) for why. */
#include "argmax_row.h"

void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, cols);
}
