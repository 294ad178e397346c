/* The first index of a row's largest value with torch.argmax's rules (a row holding NaN
 * answers its first NaN): argmax.c's rows, and the decode step's greedy tokens. */
#ifndef PDSERVE_ARGMAX_ROW_H
#define PDSERVE_ARGMAX_ROW_H
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define ARGMAX_CHAINS 4 /* independent maxima: one chain left the loop latency-bound */

/* The first index of the row's largest value, in one pass: each lane keeps its largest
 * value and where it first saw it (a later equal value does not replace it), the
 * lanes' winners are then compared by value, and by index among equals. A NaN anywhere
 * sends the row to a second pass for its first NaN (torch's answer). */
static int64_t row_argmax(const float *row, int64_t cols) {
    vf best[ARGMAX_CHAINS];
    vi at[ARGMAX_CHAINS], nan = (vi){0};
    const vi lanes = vlanes();
    for (int c = 0; c < ARGMAX_CHAINS; c++) {
        best[c] = vset1(-INFINITY);
        at[c] = (vi){0} + (int32_t)cols;  /* nothing seen: loses every index tie */
    }
    int64_t k = 0;
    for (; k + ARGMAX_CHAINS * VW <= cols; k += ARGMAX_CHAINS * VW)
        for (int c = 0; c < ARGMAX_CHAINS; c++) {
            const vf v = vload(row + k + c * VW);
            const vi more = v > best[c];
            nan |= v != v;
            best[c] = vselect(more, v, best[c]);
            at[c] = (more & (lanes + (int32_t)(k + c * VW))) | (~more & at[c]);
        }
    for (; k < cols; k += VW) {
        const vf v = vfirst_n(vload_n(row + k, cols - k), cols - k, -INFINITY);
        const vi more = v > best[0];
        nan |= v != v;
        best[0] = vselect(more, v, best[0]);
        at[0] = (more & (lanes + (int32_t)k)) | (~more & at[0]);
    }
    if (vany(nan)) {
        for (int64_t j = 0; j < cols; j++)
            if (row[j] != row[j]) return j;
    }
    float top = -INFINITY;
    int64_t found = cols;
    for (int c = 0; c < ARGMAX_CHAINS; c++)
        for (int i = 0; i < VW; i++)
            if (best[c][i] > top || (best[c][i] == top && at[c][i] < found)) {
                top = best[c][i];
                found = at[c][i];
            }
    return found < cols ? found : 0;  /* every value -inf: the first */
}

#endif
