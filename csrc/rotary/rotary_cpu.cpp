// rotary's CPU kernel: rows of q, then of k, spread over threads; each row one loop over the
// pairs in float32 (float64 for float64), which the compiler vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "common/cpu_grain.h"
#include "rotary/rotary.h"

namespace gpu_puzzles {
namespace {

template <typename TI, typename TC, typename TO>
void run(const RotaryArgs& a) {
  using A = std::conditional_t<std::is_same<TI, double>::value, double, float>;
  const int64_t h = a.R / 2;
  for (const RotaryOperand& o : a.op) {
    at::parallel_for(0, o.rows, grain_rows(a.D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const RowIndex ri = row_index(o.xr, r);
        const TI* x = static_cast<const TI*>(o.x) + row_start(o.xr, ri);
        const TC* cs = static_cast<const TC*>(a.cos) + row_start(o.cr, ri);
        const TC* sn = static_cast<const TC*>(a.sin) + row_start(o.sr, ri);
        TO* y = static_cast<TO*>(o.out) + r * a.D;
        for (int64_t j = 0; j < h; ++j) {
          const A u = static_cast<A>(x[j]), v = static_cast<A>(x[h + j]);
          const A ca = static_cast<A>(cs[j]), cb = static_cast<A>(cs[h + j]);
          const A sa = static_cast<A>(sn[j]), sb = static_cast<A>(sn[h + j]);
          y[j] = static_cast<TO>(a.backward ? u * ca + v * sb : u * ca - v * sa);
          y[h + j] = static_cast<TO>(a.backward ? v * cb - u * sa : v * cb + u * sb);
        }
        for (int64_t j = a.R; j < a.D; ++j) y[j] = static_cast<TO>(static_cast<A>(x[j]));
      }
    });
  }
}

template <typename F>
void each_type(DType dt, F&& f) {
  switch (dt) {
    case DType::Float64:
      return f(double{});
    case DType::Float16:
      return f(c10::Half{});
    case DType::BFloat16:
      return f(c10::BFloat16{});
    default:
      return f(float{});
  }
}

}  // namespace

// The element-type combinations rotary_cuda takes, the same way.
void rotary_cpu_kernel(const RotaryArgs& a) {
  if (a.in == a.out) return each_type(a.in, [&](auto t) { run<decltype(t), decltype(t), decltype(t)>(a); });
  if (a.out == DType::Float32) return each_type(a.in, [&](auto t) { run<decltype(t), float, float>(a); });
  each_type(a.out, [&](auto t) { run<float, float, decltype(t)>(a); });
}

}  // namespace gpu_puzzles
