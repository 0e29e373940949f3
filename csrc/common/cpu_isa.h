// Run-time SIMD dispatch for CPU kernels, the way ATen does it for its own.
//
// A kernel file opts in by putting its kernels in `namespace GP_CPU_NS` (inside
// namespace gpu_puzzles). setup.py then compiles that file once per SIMD level:
//   baseline : the compiler's default target (every x86-64 / aarch64 CPU), GP_CPU_NS = cpu_baseline;
//   avx2     : -mavx2 -mfma -mf16c, CPU_CAPABILITY_AVX2 (at::vec's 256-bit Vectorized), cpu_avx2;
//   avx512   : -mavx512f/bw/vl/dq -mfma, CPU_CAPABILITY_AVX512 (512-bit Vectorized), cpu_avx512;
// the last two only on x86-64 with GCC/Clang, where setup.py defines GP_CPU_MULTI_ISA for
// every file. The op's header declares each entry with GP_CPU_DECLARE, and the host code
// calls it through GP_CPU_CALL(name)(args...), which picks the copy for cpu_isa().
// Rules for a kernel file: no overloaded entry names (GP_CPU_CALL takes their address),
// and nothing outside GP_CPU_NS (it would be defined three times).
//
// Why a wheel never runs an instruction the CPU lacks: cpu_isa() checks the CPU's
// features at run time, and the linker keeps the first copy of an inline function
// that several objects emit; the baseline objects are linked first and the avx2
// ones before the avx512 ones (setup.py), so code of a lower level never calls a
// copy compiled for a higher one.
#pragma once

namespace gpu_puzzles {

enum class CpuIsa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

// The level the CPU kernels run at now: the highest one this build holds and the
// CPU supports, capped by PyTorch's ATEN_CPU_CAPABILITY (read by PyTorch once per
// process) and by the `cpu_simd` knob (tests force the lower levels with it).
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

}  // namespace gpu_puzzles

#if defined(CPU_CAPABILITY_AVX512)
#define GP_CPU_NS cpu_avx512
#elif defined(CPU_CAPABILITY_AVX2)
#define GP_CPU_NS cpu_avx2
#else
#define GP_CPU_NS cpu_baseline
#endif

// In the op's header, inside namespace gpu_puzzles: GP_CPU_DECLARE(void, softmax_forward_cpu, const SoftmaxCpuArgs&);
#ifdef GP_CPU_MULTI_ISA
#define GP_CPU_DECLARE(ret, name, ...) \
  namespace cpu_baseline {             \
  ret name(__VA_ARGS__);               \
  }                                    \
  namespace cpu_avx2 {                 \
  ret name(__VA_ARGS__);               \
  }                                    \
  namespace cpu_avx512 {               \
  ret name(__VA_ARGS__);               \
  }
#define GP_CPU_CALL(name)                                                                       \
  (::gpu_puzzles::cpu_isa() == ::gpu_puzzles::CpuIsa::Avx512 ? &::gpu_puzzles::cpu_avx512::name \
   : ::gpu_puzzles::cpu_isa() == ::gpu_puzzles::CpuIsa::Avx2 ? &::gpu_puzzles::cpu_avx2::name   \
                                                             : &::gpu_puzzles::cpu_baseline::name)
#else
#define GP_CPU_DECLARE(ret, name, ...) \
  namespace cpu_baseline {             \
  ret name(__VA_ARGS__);               \
  }
#define GP_CPU_CALL(name) (&::gpu_puzzles::cpu_baseline::name)
#endif
