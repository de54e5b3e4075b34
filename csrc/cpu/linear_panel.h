// A panel row of the linear kernels (csrc/cpu/linear.cpp, linear_int8.cpp, linear_wonly.h): 16 output
// features held as two vectors of 8 (outputs 0-7, 8-15), of which the last panel of a layer whose N is
// not a multiple of 16 has only ncols (1..16) real ones.
#pragma once

#include "vec.h"

namespace pagedgen::cpu {

// The first ncols of p's 16 values into lo and hi; lanes past ncols read as 0 (never past p + ncols).
template <typename T>
PAGEDGEN_ALWAYS_INLINE void load_panel_row(const T* p, int ncols, Vec<8>& lo, Vec<8>& hi) {
  lo = ncols >= 8 ? load<8>(p) : load_partial<8>(p, ncols);
  hi = ncols == 16 ? load<8>(p + 8) : ncols > 8 ? load_partial<8>(p + 8, ncols - 8) : Vec<8>{};
}

// lo and hi rounded to T (store's rounding), the first ncols of them written to p.
template <typename T>
PAGEDGEN_ALWAYS_INLINE void store_panel_row(T* p, const Vec<8>& lo, const Vec<8>& hi, int ncols) {
  if (ncols == 16) {
    store<8>(p, lo);
    store<8>(p + 8, hi);
  } else if (ncols > 8) {
    store<8>(p, lo);
    store_partial<8>(p + 8, hi, ncols - 8);
  } else {
    store_partial<8>(p, lo, ncols);
  }
}

}  // namespace pagedgen::cpu
