// cpu_isa(): which copy of a CPU kernel runs (see cpu_isa.h).
#include "common/cpu_isa.h"

#include <ATen/Version.h>
#include <torch/library.h>

#include <string>

#include "common/kernel_choice.h"

namespace gpu_puzzles {
namespace {

// The best level this build holds that both the CPU and PyTorch's own dispatch
// allow (ATEN_CPU_CAPABILITY=default then also keeps ours at the baseline).
CpuIsa detect() {
#if defined(GP_CPU_MULTI_ISA) && (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const std::string torch_cap = at::get_cpu_capability();  // "DEFAULT", "AVX2", "AVX512"
  if (avx512 && torch_cap == "AVX512") return CpuIsa::Avx512;
  if (avx2 && (torch_cap == "AVX2" || torch_cap == "AVX512")) return CpuIsa::Avx2;
#endif
  return CpuIsa::Baseline;
}

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa best = detect();
  // The knob's values are baseline | avx2 | avx512, in the enum's order: a cap, never a raise.
  const int forced = knob(Knob::CpuSimd) - 1;
  return forced >= 0 && forced < static_cast<int>(best) ? static_cast<CpuIsa>(forced) : best;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512:
      return "avx512";
    case CpuIsa::Avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

// Private: the level the CPU kernels run at now (tests check the cpu_simd knob with it).
TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  m.def("_cpu_isa() -> str", [] { return std::string(cpu_isa_name(cpu_isa())); });
}

}  // namespace gpu_puzzles
