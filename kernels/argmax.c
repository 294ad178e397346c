/* Row-wise argmax of fp32 logits with torch.argmax's rules: the first maximal index; a
 * row holding NaN answers its first NaN. See sampling.py (greedy) for why. */
#include <math.h>
#include <stdint.h>

#include "simd.h"

void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        vf best = vset1(-INFINITY);
        vi nan = (vi){0};
        for (int64_t k = 0; k < cols; k += VW) {
            vf v = vfirst_n(vload_n(row + k, cols - k), cols - k, -INFINITY);
            nan |= v != v;
            best = vmax(v, best); /* a NaN v keeps best */
        }
        const int has_nan = vany(nan);
        const float target = vmax_lanes(best);
        int64_t found = 0;
        for (int64_t k = 0; k < cols; k += VW) {
            vf v = vfirst_n(vload_n(row + k, cols - k), cols - k, -INFINITY);
            vi hit = has_nan ? v != v : v == target;
            if (vany(hit)) {
                for (int i = 0; i < VW; i++)
                    if (hit[i]) { found = k + i; break; }
                break;
            }
        }
        out[r] = found;
    }
}
