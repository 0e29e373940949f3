// The knob table behind kernel_choice.h and the private ops that set it
// (gpu_puzzles::_set_knob, _knobs; schemas in registration.cpp).
#include "common/kernel_choice.h"

#include <torch/library.h>

#include <array>
#include <atomic>
#include <string>
#include <vector>

namespace gpu_puzzles {
namespace {

struct KnobSpec {
  const char* name;
  std::vector<const char*> values;
};

// One row per Knob, in the enum's order.
const std::array<KnobSpec, static_cast<int>(Knob::Count)>& knob_table() {
  static const std::array<KnobSpec, static_cast<int>(Knob::Count)> t = {{
      {"softmax_rows", {"cluster", "staged", "smem", "bulk"}},
      {"softmax_cluster", {"4", "8", "16"}},
      {"softmax_stages", {"1", "2", "3"}},
      {"softmax_cols", {"inner", "staged"}},
      {"softmax_col_rows_fwd", {"4", "8", "16"}},
      {"softmax_col_rows_bwd", {"4", "8", "16"}},
      {"softmax_grid", {"1", "4"}},
      {"softmax_smem_align", {"aligned", "same", "shifted"}},
      {"attention_fwd", {"mma", "mma_r32", "wgmma", "wgmma3", "ws", "ws2", "ws3", "ws192"}},
      {"attention_fwd_warps", {"4", "8"}},
      {"attention_bwd", {"mma", "wgmma", "wgmma_split", "wgmma_turns"}},
      {"attention_order", {"rows", "longest"}},
      {"attention_fwd_grid", {"blocks", "persistent"}},
      {"attention_bwd_grid", {"blocks", "persistent"}},
      {"layernorm_linear_evt", {"evt", "cublas"}},
      {"layernorm_linear_pdl", {"pdl", "plain"}},
      {"layernorm_linear_plan", {"fold", "normalize"}},
      {"cpu_simd", {"baseline", "avx2", "avx512"}},
      {"cross_entropy_chunk", {"1", "2", "3", "5", "8", "16", "64", "256", "1024", "2048", "4096", "8192"}},
  }};
  return t;
}

std::atomic<int> g_knobs[static_cast<int>(Knob::Count)];

std::string joined(const std::vector<const char*>& v) {
  std::string s;
  for (const char* x : v) s += (s.empty() ? "" : ", ") + std::string(x);
  return s;
}

// Sets knob `name` to `value` ("" or "auto" clears it); returns the previous value ("" if none).
std::string set_knob(const std::string& name, const std::string& value) {
  const auto& t = knob_table();
  for (size_t k = 0; k < t.size(); ++k) {
    if (name != t[k].name) continue;
    int idx = 0;
    if (!value.empty() && value != "auto") {
      for (size_t i = 0; i < t[k].values.size(); ++i)
        if (value == t[k].values[i]) idx = static_cast<int>(i) + 1;
      TORCH_CHECK(idx != 0, "gpu_puzzles: knob ", name, " takes one of auto, ", joined(t[k].values), "; got '", value,
                  "'");
    }
    const int old = g_knobs[k].exchange(idx, std::memory_order_relaxed);
    return old == 0 ? std::string() : std::string(t[k].values[old - 1]);
  }
  std::string names;
  for (const auto& s : t) names += (names.empty() ? "" : ", ") + std::string(s.name);
  TORCH_CHECK(false, "gpu_puzzles: unknown knob '", name, "'; the knobs are ", names);
}

// "name=value1|value2|...:current" for every knob (current empty when not overridden).
std::vector<std::string> list_knobs() {
  std::vector<std::string> out;
  const auto& t = knob_table();
  for (size_t k = 0; k < t.size(); ++k) {
    std::string s = std::string(t[k].name) + "=";
    for (size_t i = 0; i < t[k].values.size(); ++i) s += (i ? "|" : "") + std::string(t[k].values[i]);
    const char* cur = knob_value(static_cast<Knob>(k));
    out.push_back(s + ":" + (cur ? cur : ""));
  }
  return out;
}

}  // namespace

int knob(Knob k) { return g_knobs[static_cast<int>(k)].load(std::memory_order_relaxed); }

const char* knob_value(Knob k) {
  const int i = knob(k);
  return i == 0 ? nullptr : knob_table()[static_cast<int>(k)].values[i - 1];
}

int knob_int(Knob k, int fallback) {
  const char* v = knob_value(k);
  return v == nullptr ? fallback : std::stoi(v);
}

TORCH_LIBRARY_FRAGMENT(gpu_puzzles, m) {
  m.def("_set_knob(str name, str value) -> str", &set_knob);
  m.def("_knobs() -> str[]", &list_knobs);
}

}  // namespace gpu_puzzles
