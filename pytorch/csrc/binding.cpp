// flashgen: the compiled host path of flashgen.torch (`flashgen.torch.binding` builds and
// loads it). It defines the operators flashgen::fwd and flashgen::bwd (the schemas come from
// Python, inferred from the Python implementations in pytorch/ops.py, so the two paths take
// the same arguments) with boxed C++ kernels for CUDA and an autograd kernel in C++, and
// flashgen::decode and flashgen::merge_states (pytorch/kvcache.py) with boxed C++ kernels.
//
// Glossary
//   plan      everything a launch needs that the call's key decides: the kernel's C entry
//             points (`<name>_launch`, `_check`, `_workspace_bytes`), the runtime window and
//             the score-stage slots. Made once per key by the Python planner (which runs
//             every check of the Python path and raises its errors), then reused.
//   key       what the Python path's verdict and kernel choice depend on: the layouts
//             (dtype, device, sizes, strides) of every tensor argument, packed lengths
//             excepted, and every scalar argument but the per-call values (softmax_scale,
//             varlen max_seqlen). Equal keys give equal plans.
//   fallback  a call the fast path does not serve (empty or misaligned tensors, values the
//             planner must check; dropout in a build without torch's CUDA generator): it
//             runs the Python implementation, which launches through ctypes or raises the
//             Python path's error.
//
// Why a cache of plans and not a port of the checks: the checks, their messages and the
// kernel selection live once, in Python; this file only fills the C parameter structs
// (params.h, bwd_params.h, included so the compiler checks every field name) and launches.
// tests/test_torch_binding.py holds the structs it fills to the Python path's, byte for byte.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <limits>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "bwd_params.h"
#include "params.h"

// With a CUDA build of torch (binding.py links libtorch_cuda and defines this), dropout
// forwards take the Philox state of the device's default CUDA generator here, graph-safe
// under capture; without it they take the Python implementation.
#ifdef FLASHGEN_CUDA_GENERATOR
#include <ATen/cuda/CUDAGeneratorImpl.h>
constexpr bool kCudaGenerator = true;
#else
constexpr bool kCudaGenerator = false;
#endif

namespace py = pybind11;
using at::Tensor;
using c10::IValue;

namespace {

// ---- the Python side: planners, fallbacks and the launch-error raiser (set by install()).
struct Callbacks {
  py::object fwd_plan, fwd_py, bwd_plan, bwd_py, check_backward, launch_error;
  py::object decode_plan, decode_py;  // None until install_decode()
  py::object merge_plan, merge_py;    // None until install_merge()
};
Callbacks* g_py = nullptr;  // leaked on purpose: never destroyed without the GIL at exit

std::atomic<int64_t> g_hits{0}, g_misses{0}, g_fallbacks{0};

// ---- keys ---------------------------------------------------------------------------------
constexpr int kKeyMax = 160;

struct Key {
  std::array<int64_t, kKeyMax> v;
  int n = 0;
  bool overflow = false;
  void push(int64_t x) {
    if (n < kKeyMax) {
      v[n++] = x;
    } else {
      overflow = true;
    }
  }
  void push_f64(double x) {
    int64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    push(bits);
  }
  // A tensor's layout; `packed`: dim 0 is a packed length (varlen), left out of the key.
  void push_tensor(const Tensor& t, bool packed) {
    if (!t.defined()) {
      push(-1);
      return;
    }
    push(static_cast<int64_t>(t.scalar_type()));
    push(static_cast<int64_t>(t.device().type()));
    push(t.device().index());
    const int64_t dim = t.dim();
    push(dim);
    for (int64_t d = 0; d < dim; ++d) {
      push(packed && d == 0 ? -2 : t.size(d));
      push(t.stride(d));
    }
  }
  bool operator==(const Key& o) const {
    return n == o.n && std::memcmp(v.data(), o.v.data(), n * sizeof(int64_t)) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int i = 0; i < k.n; ++i) {
      h ^= static_cast<uint64_t>(k.v[i]);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// ---- plans ---------------------------------------------------------------------------------
using LaunchFn = int (*)(const void* params, void* stream);
using CheckFn = const char* (*)(const void* params);
using WorkspaceFn = size_t (*)(const void* params);

// A score-stage slot: one 8-byte field of fg_score_params and where its value comes from.
enum SlotKind : int64_t { kConst = 0, kAlibiPtr = 1, kSinkPtr = 2, kDsinkPtr = 3 };
struct Slot {
  int64_t index, kind, value;
};

struct Plan {
  bool python = false;  // the Python implementation serves every call of this key
  std::string name;
  LaunchFn launch = nullptr;
  CheckFn check = nullptr;
  WorkspaceFn workspace = nullptr;
  int64_t window_left = -1, window_right = -1;
  std::vector<Slot> slots;
  int64_t block_m = 1;
  bool deterministic = false;
  int64_t philox_step = 4;  // ops.PHILOX_OFFSET_STEP: one forward's Philox offset increment
};

constexpr size_t kPlanLimit = 1024;  // bounded like the Python memos: cleared when full

// A bounded, locked map from keys (the plans of each op, the backward-checked keys).
template <class V>
struct KeyMap {
  std::mutex mu;
  std::unordered_map<Key, V, KeyHash> map;
  bool find(const Key& key, V* out) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(key);
    if (it == map.end()) return false;
    *out = it->second;
    return true;
  }
  void put(const Key& key, V value) {
    std::lock_guard<std::mutex> lock(mu);
    if (map.size() >= kPlanLimit) map.clear();
    map[key] = std::move(value);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    map.clear();
  }
};
KeyMap<std::shared_ptr<const Plan>> g_fwd_plans, g_bwd_plans;
KeyMap<bool> g_backward_ok;  // check_backward's accepted forward keys (asked once per key)

// ---- IValue <-> Python ---------------------------------------------------------------------
py::object to_py(const IValue& v) {
  if (v.isNone()) return py::none();
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isString()) return py::str(v.toStringRef());
  if (v.isSymInt()) return py::cast(v.toSymInt());
  if (v.isSymFloat()) return py::cast(c10::Scalar(v.toSymFloat()));
  if (v.isSymBool()) return py::cast(c10::Scalar(v.toSymBool()));
  TORCH_CHECK(false, "flashgen binding: unexpected argument type ", v.tagKind());
}

py::tuple py_args(c10::ArrayRef<IValue> args) {
  py::tuple t(args.size());
  for (size_t i = 0; i < args.size(); ++i) t[i] = to_py(args[i]);
  return t;
}

int64_t as_int(const py::handle& h) { return h.cast<int64_t>(); }

// A plan's name and C entry points from the planner's dict (ops._plan, kvcache._decode_plan).
template <class P>
void read_entry_points(const py::dict& d, P* plan) {
  auto fn = [&](const char* key) {
    return reinterpret_cast<void*>(static_cast<uintptr_t>(as_int(d[key])));
  };
  plan->name = d["name"].cast<std::string>();
  plan->launch = reinterpret_cast<LaunchFn>(fn("launch"));
  plan->check = reinterpret_cast<CheckFn>(fn("check"));
  plan->workspace = reinterpret_cast<WorkspaceFn>(fn("workspace"));
}

std::shared_ptr<const Plan> plan_from_py(const py::object& obj) {
  auto plan = std::make_shared<Plan>();
  if (obj.is_none()) {
    plan->python = true;
    return plan;
  }
  py::dict d = obj.cast<py::dict>();
  read_entry_points(d, plan.get());
  plan->window_left = as_int(d["window_left"]);
  plan->window_right = as_int(d["window_right"]);
  plan->block_m = as_int(d["block_m"]);
  plan->deterministic = d["deterministic"].cast<bool>();
  plan->philox_step = as_int(d["philox_step"]);
  for (auto item : d["score_slots"]) {
    py::tuple s = item.cast<py::tuple>();
    plan->slots.push_back({as_int(s[0]), as_int(s[1]), as_int(s[2])});
  }
  TORCH_CHECK(plan->launch != nullptr && plan->check != nullptr,
              "flashgen binding: the planner returned no entry points for ", plan->name);
  return plan;
}

// Run a Python callable on the boxed arguments; replaces them on the stack by its results
// (a tuple of tensors).
void run_python(const py::object& fn, torch::jit::Stack* stack, size_t nargs) {
  std::vector<IValue> outs;
  {
    py::gil_scoped_acquire gil;
    py::object res = fn(*py_args(torch::jit::last(*stack, nargs)));
    for (auto item : res.cast<py::tuple>()) outs.emplace_back(item.cast<Tensor>());
  }
  torch::jit::drop(*stack, nargs);
  for (auto& o : outs) torch::jit::push(*stack, std::move(o));
}

// The plan of a key: cached, else made by the Python planner (which may raise) and cached.
template <class P>
std::shared_ptr<const P> get_plan(KeyMap<std::shared_ptr<const P>>& cache, const Key& key,
                                  const py::object& planner,
                                  std::shared_ptr<const P> (*from_py)(const py::object&),
                                  torch::jit::Stack* stack, size_t nargs) {
  std::shared_ptr<const P> plan;
  if (!key.overflow && cache.find(key, &plan)) {
    g_hits.fetch_add(1, std::memory_order_relaxed);
    return plan;
  }
  g_misses.fetch_add(1, std::memory_order_relaxed);
  {
    py::gil_scoped_acquire gil;
    plan = from_py(planner(*py_args(torch::jit::last(*stack, nargs))));
  }
  if (!key.overflow) cache.put(key, plan);
  return plan;
}

// Raises the Python path's LaunchError (with the launcher's message when it refused).
[[noreturn]] void launch_failed(const std::string& name, CheckFn check, int err,
                                const void* params) {
  const char* msg = err == 1 ? check(params) : nullptr;  // cudaErrorInvalidValue
  py::gil_scoped_acquire gil;
  g_py->launch_error(name, err, msg == nullptr ? py::none() : py::object(py::str(msg)));
  TORCH_CHECK(false, name, ": launch failed (", err, ")");  // launch_error raises first
}

void* current_stream(const c10::Device& device) {
  if (device.type() != c10::DeviceType::CUDA) return nullptr;  // the CPU tests' mock kernels
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(device).native_handle();
}

bool aligned(const Tensor& t) {
  return t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// <prefix>_batch/row/head strides of a (b, s, h, d) or packed (total, h, d) tensor.
struct Strides {
  int64_t batch, row, head;
};
Strides strides_of(const Tensor& t, bool varlen) {
  if (varlen) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void set_score_slots(fg_score_params& sp, const Plan& plan, const c10::optional<Tensor>& alibi,
                     const c10::optional<Tensor>& sink, const Tensor* dsink) {
  auto* words = reinterpret_cast<uint64_t*>(&sp);
  constexpr int64_t kWords = sizeof(fg_score_params) / sizeof(uint64_t);
  for (const Slot& s : plan.slots) {
    TORCH_CHECK(s.index >= 0 && s.index < kWords, "flashgen binding: bad score slot");
    uint64_t value = static_cast<uint64_t>(s.value);
    if (s.kind == kAlibiPtr) value = reinterpret_cast<uintptr_t>(alibi->data_ptr());
    if (s.kind == kSinkPtr) value = reinterpret_cast<uintptr_t>(sink->data_ptr());
    if (s.kind == kDsinkPtr) value = reinterpret_cast<uintptr_t>(dsink->data_ptr());
    words[s.index] = value;
  }
}

bool finite_positive(double x) { return x > 0.0 && x < std::numeric_limits<double>::infinity(); }

Tensor scalar_i64(uint64_t value) {
  return at::scalar_tensor(static_cast<int64_t>(value), at::TensorOptions().dtype(at::kLong));
}

// The forward's Philox seed and offset, from the device's default CUDA generator as torch's
// fused attention takes them (`philox_cuda_state`, which advances the generator's offset by
// `step`). Outside capture: by value, returned as 0-dim int64 CPU tensors (the Python path's
// values, ops.philox_state). Under CUDA-graph capture the state holds device pointers that
// torch refills before each replay (at::PhiloxCudaState, read as at::cuda::philox::unpack
// does: philox_seed.cuh): the kernel reads them and writes the values it used into two 0-dim
// int64 device tensors, which are returned and read back by the backward.
struct PhiloxOut {
  Tensor seed, offset;
};
PhiloxOut take_philox(fg_fwd_params& p, const Tensor& q, int64_t step) {
#ifdef FLASHGEN_CUDA_GENERATOR
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      c10::nullopt, at::cuda::detail::getDefaultCUDAGenerator(q.device().index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(static_cast<uint64_t>(step));
  }
  if (!state.captured_) {
    p.seed = state.seed_.val, p.offset = state.offset_.val;
    return {scalar_i64(p.seed), scalar_i64(p.offset)};
  }
  const auto opts = q.options().dtype(at::kLong);
  PhiloxOut out{at::empty({}, opts), at::empty({}, opts)};
  p.philox_seed_ptr = reinterpret_cast<const uint64_t*>(state.seed_.ptr);
  p.philox_offset_ptr = reinterpret_cast<const uint64_t*>(state.offset_.ptr);
  p.philox_offset_add = state.offset_intragraph_;
  p.philox_seed_out = reinterpret_cast<uint64_t*>(out.seed.data_ptr<int64_t>());
  p.philox_offset_out = reinterpret_cast<uint64_t*>(out.offset.data_ptr<int64_t>());
  return out;
#else
  (void)p, (void)q, (void)step;
  TORCH_CHECK(false, "flashgen binding: built without torch's CUDA generator");
  return {};
#endif
}

// ---- flashgen::fwd --------------------------------------------------------------------------
// q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale causal
// window_left window_right deterministic softcap alibi_slopes learnable_sink
constexpr size_t kFwdArgs = 16;

Key fwd_key(c10::ArrayRef<IValue> a, bool varlen) {
  Key key;
  key.push(1);
  for (int i = 0; i < 3; ++i) key.push_tensor(a[i].toTensor(), varlen);
  for (int i = 3; i < 5; ++i) key.push_tensor(a[i].isNone() ? Tensor() : a[i].toTensor(), false);
  key.push_f64(a[7].toDouble());  // dropout_p
  key.push(a[9].toBool());
  key.push(a[10].toInt());
  key.push(a[11].toInt());
  key.push(a[12].toBool());
  key.push_f64(a[13].toDouble());  // softcap
  for (int i = 14; i < 16; ++i)
    key.push_tensor(a[i].isNone() ? Tensor() : a[i].toTensor(), false);
  return key;
}

void fwd_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto a = torch::jit::last(*stack, kFwdArgs);
  const Tensor q = a[0].toTensor(), k = a[1].toTensor(), v = a[2].toTensor();
  const auto cu_q = a[3].toOptional<Tensor>(), cu_k = a[4].toOptional<Tensor>();
  const bool varlen = cu_q.has_value() || cu_k.has_value();
  const auto plan =
      get_plan(g_fwd_plans, fwd_key(a, varlen), g_py->fwd_plan, &plan_from_py, stack, kFwdArgs);
  const int64_t max_q = a[5].toInt(), max_k = a[6].toInt();
  const double scale = a[8].toDouble(), dropout_p = a[7].toDouble();
  const bool serve = !plan->python && q.numel() > 0 && k.numel() > 0 && aligned(q) &&
                     aligned(k) && aligned(v) && finite_positive(scale) &&
                     (dropout_p == 0.0 || kCudaGenerator) &&
                     (!varlen || (cu_q && cu_k && max_q >= 0 && max_k >= 0 &&
                                  k.size(0) == v.size(0)));
  if (!serve) {
    g_fallbacks.fetch_add(1, std::memory_order_relaxed);
    run_python(g_py->fwd_py, stack, kFwdArgs);
    return;
  }
  const auto alibi = a[14].toOptional<Tensor>(), sink = a[15].toOptional<Tensor>();
  const int64_t batch = varlen ? cu_q->size(0) - 1 : q.size(0);
  const int64_t heads = q.size(-2), kv_heads = k.size(-2);
  const int64_t seqlen_q = varlen ? max_q : q.size(1), seqlen_k = varlen ? max_k : k.size(1);

  std::vector<int64_t> out_sizes = q.sizes().vec();
  out_sizes.back() = v.size(-1);  // out: q's shape with v's head dim (d_v)
  Tensor out = at::empty(out_sizes, q.options());
  Tensor lse = varlen ? at::empty({heads, q.size(0)}, q.options().dtype(at::kFloat))
                      : at::empty({batch, heads, seqlen_q}, q.options().dtype(at::kFloat));

  fg_fwd_params p = fg_fwd_params_default();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  const Strides sq = strides_of(q, varlen), sk = strides_of(k, varlen), sv = strides_of(v, varlen),
                so = strides_of(out, varlen);
  p.q_batch_stride = sq.batch, p.q_row_stride = sq.row, p.q_head_stride = sq.head;
  p.k_batch_stride = sk.batch, p.k_row_stride = sk.row, p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch, p.v_row_stride = sv.row, p.v_head_stride = sv.head;
  p.o_batch_stride = so.batch, p.o_row_stride = so.row, p.o_head_stride = so.head;
  p.lse_batch_stride = varlen ? 0 : lse.stride(0);
  p.lse_head_stride = varlen ? lse.stride(0) : lse.stride(1);
  p.batch = batch, p.heads = heads, p.kv_heads = kv_heads;
  p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.head_dim = q.size(-1), p.head_dim_v = v.size(-1);
  p.cu_seqlens_q = varlen ? cu_q->data_ptr<int32_t>() : nullptr;
  p.cu_seqlens_k = varlen ? cu_k->data_ptr<int32_t>() : nullptr;
  p.total_q = varlen ? q.size(0) : 0;
  p.total_k = varlen ? k.size(0) : 0;
  p.softmax_scale = scale;
  p.window_left = plan->window_left, p.window_right = plan->window_right;
  p.dropout_p = dropout_p;
  p.seed = 0, p.offset = 0;
  PhiloxOut philox;
  if (dropout_p > 0.0) philox = take_philox(p, q, plan->philox_step);
  p.blk_layout_heads = 1;
  set_score_slots(p.score, *plan, alibi, sink, nullptr);

  {
    c10::DeviceGuard guard(q.device());
    const int err = plan->launch(&p, current_stream(q.device()));
    if (err != 0) launch_failed(plan->name, plan->check, err, &p);
  }
  torch::jit::drop(*stack, kFwdArgs);
  if (!philox.seed.defined()) philox = {scalar_i64(0), scalar_i64(0)};
  torch::jit::push(*stack, std::move(out), std::move(lse), std::move(philox.seed),
                   std::move(philox.offset));
}

// ---- flashgen::bwd --------------------------------------------------------------------------
// dout q k v out softmax_lse philox_seed philox_offset cu_seqlens_q cu_seqlens_k max_seqlen_q
// max_seqlen_k dropout_p softmax_scale causal window_left window_right deterministic softcap
// alibi_slopes learnable_sink
constexpr size_t kBwdArgs = 21;

Key bwd_key(c10::ArrayRef<IValue> a, bool varlen) {
  Key key;
  key.push(2);
  for (int i = 0; i < 5; ++i) key.push_tensor(a[i].toTensor(), varlen);
  key.push_tensor(a[5].toTensor(), false);  // lse: (batch, heads, sq) or (heads, total_q)
  if (varlen && a[5].toTensor().dim() == 2) {  // varlen (heads, total_q): total_q is packed
    key.v[key.n - 2] = -2;  // size(1)
    key.v[key.n - 3] = -2;  // stride(0)
  }
  for (int i = 6; i < 8; ++i) key.push_tensor(a[i].toTensor(), false);
  for (int i = 8; i < 10; ++i) key.push_tensor(a[i].isNone() ? Tensor() : a[i].toTensor(), false);
  key.push_f64(a[12].toDouble());
  key.push(a[14].toBool());
  key.push(a[15].toInt());
  key.push(a[16].toInt());
  key.push(a[17].toBool());
  key.push_f64(a[18].toDouble());
  for (int i = 19; i < 21; ++i)
    key.push_tensor(a[i].isNone() ? Tensor() : a[i].toTensor(), false);
  return key;
}

// The workspace carve of runtime/workspace.py (`workspace_layout`): fp32 dq_accum at 0, fp32
// dsum after it, int32 dq_sem (deterministic) after that, each rounded up to 256 bytes.
// tests/test_torch_binding.py holds the two to each other.
struct Carve {
  int64_t dq_accum, dsum, dq_sem, bytes;
};
int64_t round256(int64_t n) { return (n + 255) / 256 * 256; }
Carve carve_workspace(int64_t batch, int64_t seqlen_q, int64_t heads, int64_t head_dim,
                      int64_t block_m, bool deterministic) {
  const int64_t rows = batch * seqlen_q * heads;
  const int64_t dq_accum = round256(rows * head_dim * 4), dsum = round256(rows * 4);
  const int64_t tiles = (seqlen_q + block_m - 1) / block_m;
  const int64_t sem = deterministic ? round256(batch * heads * tiles * 4) : 0;
  return {0, dq_accum, deterministic ? dq_accum + dsum : -1, dq_accum + dsum + sem};
}

void bwd_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto a = torch::jit::last(*stack, kBwdArgs);
  const Tensor dout = a[0].toTensor(), q = a[1].toTensor(), k = a[2].toTensor(),
               v = a[3].toTensor(), out = a[4].toTensor(), lse = a[5].toTensor();
  const Tensor seed = a[6].toTensor(), offset = a[7].toTensor();
  const auto cu_q = a[8].toOptional<Tensor>(), cu_k = a[9].toOptional<Tensor>();
  const bool varlen = cu_q.has_value() || cu_k.has_value();
  const auto plan =
      get_plan(g_bwd_plans, bwd_key(a, varlen), g_py->bwd_plan, &plan_from_py, stack, kBwdArgs);
  const int64_t max_q = a[10].toInt(), max_k = a[11].toInt();
  const double scale = a[13].toDouble();
  const bool serve =
      !plan->python && q.numel() > 0 && k.numel() > 0 && aligned(q) && aligned(k) &&
      aligned(v) && aligned(out) && aligned(dout) && finite_positive(scale) &&
      (!varlen || (cu_q && cu_k && max_q >= 0 && max_k >= 0 && k.size(0) == v.size(0) &&
                   out.size(0) == q.size(0) && dout.size(0) == q.size(0) &&
                   lse.size(1) == q.size(0)));
  if (!serve) {
    g_fallbacks.fetch_add(1, std::memory_order_relaxed);
    run_python(g_py->bwd_py, stack, kBwdArgs);
    return;
  }
  const auto alibi = a[19].toOptional<Tensor>(), sink = a[20].toOptional<Tensor>();
  const int64_t batch = varlen ? cu_q->size(0) - 1 : q.size(0);
  const int64_t heads = q.size(-2), kv_heads = k.size(-2);
  const int64_t seqlen_q = varlen ? max_q : q.size(1), seqlen_k = varlen ? max_k : k.size(1);

  Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
         dv = at::empty(v.sizes(), v.options());
  Tensor dsink = at::empty({sink ? heads : 0}, q.options().dtype(at::kFloat));

  fg_bwd_params p = fg_bwd_params_default();
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.o = out.data_ptr(), p.dout = dout.data_ptr(), p.lse = lse.data_ptr<float>();
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  const Strides s_q = strides_of(q, varlen), s_k = strides_of(k, varlen),
                s_v = strides_of(v, varlen), s_o = strides_of(out, varlen),
                s_do = strides_of(dout, varlen), s_dq = strides_of(dq, varlen),
                s_dk = strides_of(dk, varlen), s_dv = strides_of(dv, varlen);
  p.q_batch_stride = s_q.batch, p.q_row_stride = s_q.row, p.q_head_stride = s_q.head;
  p.k_batch_stride = s_k.batch, p.k_row_stride = s_k.row, p.k_head_stride = s_k.head;
  p.v_batch_stride = s_v.batch, p.v_row_stride = s_v.row, p.v_head_stride = s_v.head;
  p.o_batch_stride = s_o.batch, p.o_row_stride = s_o.row, p.o_head_stride = s_o.head;
  p.do_batch_stride = s_do.batch, p.do_row_stride = s_do.row, p.do_head_stride = s_do.head;
  p.dq_batch_stride = s_dq.batch, p.dq_row_stride = s_dq.row, p.dq_head_stride = s_dq.head;
  p.dk_batch_stride = s_dk.batch, p.dk_row_stride = s_dk.row, p.dk_head_stride = s_dk.head;
  p.dv_batch_stride = s_dv.batch, p.dv_row_stride = s_dv.row, p.dv_head_stride = s_dv.head;
  p.lse_batch_stride = varlen ? 0 : lse.stride(0);
  p.lse_head_stride = varlen ? lse.stride(0) : lse.stride(1);
  p.batch = batch, p.heads = heads, p.kv_heads = kv_heads;
  p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.head_dim = q.size(-1), p.head_dim_v = v.size(-1);
  p.cu_seqlens_q = varlen ? cu_q->data_ptr<int32_t>() : nullptr;
  p.cu_seqlens_k = varlen ? cu_k->data_ptr<int32_t>() : nullptr;
  p.total_q = varlen ? q.size(0) : 0;
  p.total_k = varlen ? k.size(0) : 0;
  p.softmax_scale = scale;
  p.window_left = plan->window_left, p.window_right = plan->window_right;
  p.dropout_p = a[12].toDouble();
  if (seed.is_cpu()) {  // the forward's values
    p.seed = static_cast<uint64_t>(*seed.data_ptr<int64_t>());
    p.offset = static_cast<uint64_t>(*offset.data_ptr<int64_t>());
  } else {  // a captured forward's: the kernel reads what that forward wrote
    p.philox_seed_ptr = reinterpret_cast<const uint64_t*>(seed.data_ptr<int64_t>());
    p.philox_offset_ptr = reinterpret_cast<const uint64_t*>(offset.data_ptr<int64_t>());
  }
  p.blk_layout_heads = 1;
  set_score_slots(p.score, *plan, alibi, sink, &dsink);

  const Carve carve =
      carve_workspace(batch, seqlen_q, heads, q.size(-1), plan->block_m, plan->deterministic);
  TORCH_CHECK(plan->workspace != nullptr, plan->name,
              " exports no <name>_workspace_bytes: not a backward kernel library");
  const int64_t asked = static_cast<int64_t>(plan->workspace(&p));
  TORCH_CHECK(asked >= carve.bytes, plan->name, "_workspace_bytes returned ", asked,
              " bytes, less than the ", carve.bytes,
              " the dq_accum + dsum (+ dq_sem) carve needs");
  Tensor workspace = at::empty({asked}, q.options().dtype(at::kByte));
  auto* base = static_cast<uint8_t*>(workspace.data_ptr());
  p.dq_accum = reinterpret_cast<float*>(base + carve.dq_accum);
  p.dsum = reinterpret_cast<float*>(base + carve.dsum);
  if (plan->deterministic) p.dq_sem = reinterpret_cast<int32_t*>(base + carve.dq_sem);
  {
    c10::DeviceGuard guard(q.device());
    const int err = plan->launch(&p, current_stream(q.device()));
    if (err != 0) launch_failed(plan->name, plan->check, err, &p);
  }
  torch::jit::drop(*stack, kBwdArgs);
  torch::jit::push(*stack, std::move(dq), std::move(dk), std::move(dv), std::move(dsink));
}

// ---- plans as data: flashgen::decode and flashgen::merge_states --------------------------------
// A words plan is data, not named fields: the Python planner packs the parameter struct of
// the planning call (`template_words`, every field of the struct as an 8-byte word) and lists
// the words that change from call to call (`patches`: which word, and from what). The key
// holds every layout and scalar the constant words are derived from.

enum PatchKind : int64_t {
  kPatchArgPtr = 0,     // the data pointer of tensor argument `arg` (0 if None)
  kPatchOutPtr = 1,     // the data pointer of output `arg` (0: out, 1: lse)
  kPatchWorkspace = 2,  // the workspace's data pointer
  kPatchWorkspaceSize = 3,
  kPatchArgF64 = 4,     // float argument `arg`, as a double
  kPatchArgClamped = 5, // int argument `arg`, clamped to [0, value]
};
struct Patch {
  int64_t word, kind, arg, value;
};

struct WordsPlan {
  bool python = false;
  std::string name;
  LaunchFn launch = nullptr;
  CheckFn check = nullptr;
  WorkspaceFn workspace = nullptr;
  std::vector<uint64_t> words;  // the struct of the planning call
  std::vector<Patch> patches;
  std::vector<int64_t> out_shape, lse_shape;
  c10::ScalarType out_dtype = c10::ScalarType::Undefined;  // merge: out's (decode: q's)
  int64_t workspace_header = 0;  // decode: the workspace's least size (the error word's header)
};

// The fields every words plan has; `what` names the op in messages, `nargs` bounds `arg`.
void read_words_plan(const py::dict& d, WordsPlan* plan, const char* what, size_t nargs) {
  read_entry_points(d, plan);
  for (auto w : d["template_words"]) plan->words.push_back(static_cast<uint64_t>(as_int(w)));
  for (auto item : d["patches"]) {
    py::tuple t = item.cast<py::tuple>();
    plan->patches.push_back({as_int(t[0]), as_int(t[1]), as_int(t[2]), as_int(t[3])});
  }
  for (auto x : d["out_shape"]) plan->out_shape.push_back(as_int(x));
  for (auto x : d["lse_shape"]) plan->lse_shape.push_back(as_int(x));
  TORCH_CHECK(plan->launch && plan->check, "flashgen binding: the ", what,
              " planner returned no entry points for ", plan->name);
  for (const Patch& p : plan->patches) {
    TORCH_CHECK(p.word >= 0 && p.word < static_cast<int64_t>(plan->words.size()),
                "flashgen binding: bad ", what, " patch");
    const bool arg = p.kind == kPatchArgPtr || p.kind == kPatchArgF64 || p.kind == kPatchArgClamped;
    TORCH_CHECK(!arg || (p.arg >= 0 && p.arg < static_cast<int64_t>(nargs)),
                "flashgen binding: bad ", what, " patch argument");
  }
}

// The struct of a call: the plan's words with its patches applied (the workspace's words are
// left to the caller, which gets their indices; -1 where the plan has none).
std::vector<uint64_t> patched_words(const WordsPlan& plan, c10::ArrayRef<IValue> a,
                                    const Tensor& out, const Tensor& lse, int64_t* ws_word,
                                    int64_t* ws_size_word) {
  std::vector<uint64_t> words = plan.words;
  auto ptr_of = [](const IValue& x) -> uint64_t {
    return x.isNone() ? 0 : reinterpret_cast<uintptr_t>(x.toTensor().data_ptr());
  };
  *ws_word = -1, *ws_size_word = -1;
  for (const Patch& p : plan.patches) {
    uint64_t value = 0;
    switch (p.kind) {
      case kPatchArgPtr: value = ptr_of(a[p.arg]); break;
      case kPatchOutPtr:
        value = reinterpret_cast<uintptr_t>(p.arg == 0 ? out.data_ptr() : lse.data_ptr());
        break;
      case kPatchWorkspace: *ws_word = p.word; break;
      case kPatchWorkspaceSize: *ws_size_word = p.word; break;
      case kPatchArgF64: {
        const double x = a[p.arg].toDouble();
        std::memcpy(&value, &x, sizeof value);
        break;
      }
      case kPatchArgClamped: {
        const int64_t x = std::max<int64_t>(0, std::min<int64_t>(a[p.arg].toInt(), p.value));
        value = static_cast<uint64_t>(x);
        break;
      }
      default: TORCH_CHECK(false, "flashgen binding: bad patch kind");
    }
    words[p.word] = value;
  }
  return words;
}

// ---- flashgen::decode -----------------------------------------------------------------------
// q k_cache v_cache cache_seqlens block_table softmax_scale causal window_left window_right
// num_splits max_seqlen_k check_inputs softcap alibi_slopes learnable_sink
constexpr size_t kDecodeArgs = 15;

KeyMap<std::shared_ptr<const WordsPlan>> g_decode_plans;

std::shared_ptr<const WordsPlan> decode_plan_from_py(const py::object& obj) {
  auto plan = std::make_shared<WordsPlan>();
  if (obj.is_none()) {
    plan->python = true;
    return plan;
  }
  py::dict d = obj.cast<py::dict>();
  read_words_plan(d, plan.get(), "decode", kDecodeArgs);
  plan->workspace_header = as_int(d["workspace_header"]);
  TORCH_CHECK(plan->workspace, "flashgen binding: the decode planner returned no workspace "
              "entry point for ", plan->name);
  return plan;
}

Key decode_key(c10::ArrayRef<IValue> a) {
  Key key;
  key.push(3);
  for (int i = 0; i < 5; ++i) key.push_tensor(a[i].isNone() ? Tensor() : a[i].toTensor(), false);
  key.push(a[6].toBool());
  key.push(a[7].toInt());
  key.push(a[8].toInt());
  key.push(a[9].toInt());
  key.push(a[11].toBool());
  key.push_f64(a[12].toDouble());
  for (int i = 13; i < 15; ++i)
    key.push_tensor(a[i].isNone() ? Tensor() : a[i].toTensor(), false);
  return key;
}

void decode_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto a = torch::jit::last(*stack, kDecodeArgs);
  const auto plan = get_plan(g_decode_plans, decode_key(a), g_py->decode_plan,
                             &decode_plan_from_py, stack, kDecodeArgs);
  const Tensor q = a[0].toTensor(), k = a[1].toTensor(), v = a[2].toTensor();
  const bool serve = !plan->python && q.numel() > 0 && k.numel() > 0 && aligned(q) &&
                     aligned(k) && aligned(v) && finite_positive(a[5].toDouble());
  if (!serve) {
    g_fallbacks.fetch_add(1, std::memory_order_relaxed);
    run_python(g_py->decode_py, stack, kDecodeArgs);
    return;
  }
  Tensor out = at::empty(plan->out_shape, q.options());
  Tensor lse = at::empty(plan->lse_shape, q.options().dtype(at::kFloat));
  int64_t ws_word = -1, ws_size_word = -1;
  std::vector<uint64_t> words = patched_words(*plan, a, out, lse, &ws_word, &ws_size_word);
  c10::DeviceGuard guard(q.device());
  const int64_t asked = static_cast<int64_t>(plan->workspace(words.data()));
  const int64_t size = std::max(asked, plan->workspace_header);
  Tensor workspace = at::empty({size}, q.options().dtype(at::kByte));
  // The error word (the header's first 4 bytes) is left as allocated: the kernels only OR
  // into it, and only check_inputs (the Python implementation) reads it. Zeroing it would be
  // a second launch per call.
  if (ws_word >= 0) words[ws_word] = reinterpret_cast<uintptr_t>(workspace.data_ptr());
  if (ws_size_word >= 0) words[ws_size_word] = static_cast<uint64_t>(size);
  const int err = plan->launch(words.data(), current_stream(q.device()));
  if (err != 0) launch_failed(plan->name, plan->check, err, words.data());
  torch::jit::drop(*stack, kDecodeArgs);
  torch::jit::push(*stack, std::move(out), std::move(lse));
}

void decode_python(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_python(g_py->decode_py, stack, kDecodeArgs);
}

// ---- flashgen::merge_states -----------------------------------------------------------------
// o_parts lse_parts out_dtype
//
// A words plan (above) of the decode struct's merge fields; its entry points are the merge
// kernel's `<name>_merge_states` (which runs `<name>_merge_check` itself and returns
// cudaErrorInvalidValue when it refuses) and `<name>_merge_check`. No workspace.
constexpr size_t kMergeArgs = 3;

KeyMap<std::shared_ptr<const WordsPlan>> g_merge_plans;

std::shared_ptr<const WordsPlan> merge_plan_from_py(const py::object& obj) {
  auto plan = std::make_shared<WordsPlan>();
  if (obj.is_none()) {
    plan->python = true;
    return plan;
  }
  py::dict d = obj.cast<py::dict>();
  read_words_plan(d, plan.get(), "merge_states", kMergeArgs);
  plan->out_dtype = d["out_dtype"].cast<at::ScalarType>();
  for (const Patch& p : plan->patches)
    TORCH_CHECK(p.kind == kPatchArgPtr || p.kind == kPatchOutPtr,
                "flashgen binding: merge_states patches are pointers only");
  return plan;
}

Key merge_key(c10::ArrayRef<IValue> a) {
  Key key;
  key.push(4);
  key.push_tensor(a[0].toTensor(), false);
  key.push_tensor(a[1].toTensor(), false);
  const std::string& name = a[2].toStringRef();  // out_dtype, 8 bytes a word
  key.push(static_cast<int64_t>(name.size()));
  for (size_t i = 0; i < name.size(); i += 8) {
    int64_t word = 0;
    std::memcpy(&word, name.data() + i, std::min<size_t>(8, name.size() - i));
    key.push(word);
  }
  return key;
}

void merge_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto a = torch::jit::last(*stack, kMergeArgs);
  const auto plan = get_plan(g_merge_plans, merge_key(a), g_py->merge_plan, &merge_plan_from_py,
                             stack, kMergeArgs);
  const Tensor o_parts = a[0].toTensor();
  const bool serve = !plan->python && o_parts.numel() > 0 && aligned(o_parts);
  if (!serve) {
    g_fallbacks.fetch_add(1, std::memory_order_relaxed);
    run_python(g_py->merge_py, stack, kMergeArgs);
    return;
  }
  Tensor out = at::empty(plan->out_shape, o_parts.options().dtype(plan->out_dtype));
  Tensor lse = at::empty(plan->lse_shape, o_parts.options().dtype(at::kFloat));
  int64_t ws_word = -1, ws_size_word = -1;
  std::vector<uint64_t> words = patched_words(*plan, a, out, lse, &ws_word, &ws_size_word);
  {
    c10::DeviceGuard guard(o_parts.device());
    const int err = plan->launch(words.data(), current_stream(o_parts.device()));
    if (err != 0) launch_failed(plan->name, plan->check, err, words.data());
  }
  torch::jit::drop(*stack, kMergeArgs);
  torch::jit::push(*stack, std::move(out), std::move(lse));
}

void merge_python(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_python(g_py->merge_py, stack, kMergeArgs);
}

// ---- autograd ---------------------------------------------------------------------------------
c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// One call of an operator below autograd on boxed arguments; returns its outputs.
std::vector<IValue> call_below_autograd(const c10::OperatorHandle& op, std::vector<IValue> args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  torch::jit::Stack stack(std::move(args));
  op.callBoxed(&stack);
  return stack;
}

c10::optional<Tensor> opt(const Tensor& t) {
  return t.defined() ? c10::optional<Tensor>(t) : c10::nullopt;
}

IValue opt_iv(const Tensor& t) { return t.defined() ? IValue(t) : IValue(); }

// dout as the kernel takes it: unit last stride, other strides multiples of 8 (else one copy).
// Symbolic strides (a traced backward) are compared symbolically: guards, not specialisation.
Tensor usable(const Tensor& dout) {
  const int64_t dim = dout.dim();
  if (dout.sym_stride(dim - 1) != 1) return dout.contiguous();
  for (int64_t d = 0; d + 1 < dim; ++d)
    if (dout.sym_stride(d) % 8 != 0) return dout.contiguous();
  return dout;
}

// fwd's arguments 5..13, which bwd takes in the same order after its tensors
constexpr int kFirstAttr = 5, kEndAttr = 14;
const char* const kAttrNames[] = {"max_seqlen_q", "max_seqlen_k", "dropout_p",
                                  "softmax_scale", "causal", "window_left",
                                  "window_right", "deterministic", "softcap"};

// The forward's other outputs (lse, seed, offset), handed out of FwdFunction::forward beside
// the one differentiable output: returned from the Function they would need
// mark_non_differentiable, which compiled autograd does not support.
struct FwdExtras {
  Tensor lse, seed, offset;
};

struct FwdFunction : public torch::autograd::Function<FwdFunction> {
  // q, k, v, the slopes and the sink are the variables autograd tracks (args holds every
  // argument, extras receives the other outputs); the slopes and softcap get no gradient,
  // as in flash-attn, but slopes that require grad make the output require grad too, as
  // the Python path's custom op does.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                std::vector<IValue> args, FwdExtras* extras,
                                                const Tensor& q, const Tensor& k, const Tensor& v,
                                                const c10::optional<Tensor>& alibi,
                                                const c10::optional<Tensor>& sink) {
    (void)q, (void)k, (void)v, (void)alibi;
    static const auto fwd = op_handle("flashgen::fwd");
    std::vector<IValue> saved_args = args;
    auto outs = call_below_autograd(fwd, std::move(args));
    Tensor out = outs[0].toTensor();
    extras->lse = outs[1].toTensor(), extras->seed = outs[2].toTensor();
    extras->offset = outs[3].toTensor();
    const auto& a = saved_args;
    ctx->save_for_backward({a[0].toTensor(), a[1].toTensor(), a[2].toTensor(), out, extras->lse,
                            extras->seed, extras->offset,
                            a[3].isNone() ? Tensor() : a[3].toTensor(),
                            a[4].isNone() ? Tensor() : a[4].toTensor(),
                            alibi ? *alibi : Tensor(), sink ? *sink : Tensor()});
    // max_q, max_k, dropout_p, scale, causal, window_left, window_right, deterministic, softcap
    for (int i = kFirstAttr; i < kEndAttr; ++i) ctx->saved_data[kAttrNames[i - kFirstAttr]] = a[i];
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto bwd = op_handle("flashgen::bwd");
    auto s = ctx->get_saved_variables();
    std::vector<IValue> args = {usable(grads[0]), s[0], s[1], s[2], s[3], s[4], s[5], s[6],
                                opt_iv(s[7]), opt_iv(s[8])};
    for (int i = kFirstAttr; i < kEndAttr; ++i)
      args.push_back(ctx->saved_data[kAttrNames[i - kFirstAttr]]);
    args.push_back(opt_iv(s[9]));
    args.push_back(opt_iv(s[10]));
    torch::jit::Stack stack(std::move(args));
    bwd.callBoxed(&stack);
    // one gradient per forward argument: (args, extras, q, k, v, slopes, sink); the sink's
    // edge is 3, or 4 after the slopes
    const int sink_edge = s[9].defined() ? 4 : 3;
    const bool want_sink = s[10].defined() && ctx->needs_input_grad(sink_edge);
    return {Tensor(), Tensor(), stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor(),
            Tensor(), want_sink ? stack[3].toTensor() : Tensor()};
  }
};

// Whether a call is being traced (fake, functional or other Python-dispatched tensors, or
// symbolic sizes or scalars): then no key is built, since reading its sizes would pin them,
// and the backward check runs every time (ops._backward_key's rule: plain tensors only).
bool traced(c10::ArrayRef<IValue> args) {
  for (const IValue& x : args) {
    if (x.isSymInt() || x.isSymFloat() || x.isSymBool()) return true;
    if (!x.isTensor()) continue;
    const auto* impl = x.toTensor().unsafeGetTensorImpl();
    if (impl->is_python_dispatch() || impl->has_symbolic_sizes_strides() ||
        impl->key_set().has(c10::DispatchKey::Functionalize))
      return true;
  }
  return false;
}

void fwd_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto a = torch::jit::last(*stack, kFwdArgs);
  const Tensor q = a[0].toTensor(), k = a[1].toTensor(), v = a[2].toTensor();
  const auto alibi = a[14].toOptional<Tensor>(), sink = a[15].toOptional<Tensor>();
  const bool grad = torch::autograd::GradMode::is_enabled() &&
                    (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                     (alibi && alibi->requires_grad()) || (sink && sink->requires_grad()));
  if (!grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(stack);
    return;
  }
  // Refuse at the forward a call whose backward has no kernel (once per key of real tensors).
  Key key;
  const bool cacheable = !traced(a);
  if (cacheable) key = fwd_key(a, !a[3].isNone() || !a[4].isNone());
  bool known = false;
  if (!cacheable || key.overflow || !g_backward_ok.find(key, &known)) {
    {
      py::gil_scoped_acquire gil;
      g_py->check_backward(*py_args(a));
    }
    if (cacheable && !key.overflow) g_backward_ok.put(key, true);
  }
  std::vector<IValue> args(a.begin(), a.end());
  FwdExtras extras;
  auto outs = FwdFunction::apply(std::move(args), &extras, q, k, v, alibi, sink);
  torch::jit::drop(*stack, kFwdArgs);
  torch::jit::push(*stack, std::move(outs[0]), std::move(extras.lse), std::move(extras.seed),
                   std::move(extras.offset));
}

// Calls on devices the fast path does not serve (CPU tensors outside the tests, ...): the
// Python implementation, which refuses them with the Python path's message.
void fwd_python(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_python(g_py->fwd_py, stack, kFwdArgs);
}
void bwd_python(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_python(g_py->bwd_py, stack, kBwdArgs);
}

// Kept alive for the life of the process: the operators' registrations.
std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
  return *libs;
}

bool g_installed = false;

void install(py::dict callbacks, const std::string& fwd_schema, const std::string& bwd_schema,
             bool cpu_for_tests) {
  TORCH_CHECK(!g_installed, "flashgen binding: install() runs once per process");
  g_py = new Callbacks{callbacks["fwd_plan"],       callbacks["fwd_py"],
                       callbacks["bwd_plan"],       callbacks["bwd_py"],
                       callbacks["check_backward"], callbacks["launch_error"],
                       py::none(),                  py::none(),
                       py::none(),                  py::none()};
  auto& libs = libraries();
  auto def = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "flashgen",
                                              c10::nullopt, __FILE__, __LINE__);
  def->def(torch::schema(fwd_schema.c_str(), c10::AliasAnalysisKind::FROM_SCHEMA));
  def->def(torch::schema(bwd_schema.c_str(), c10::AliasAnalysisKind::FROM_SCHEMA));
  libs.push_back(std::move(def));
  auto impl_for = [&](c10::DispatchKey dk, torch::CppFunction fwd, torch::CppFunction bwd) {
    auto impl = std::make_unique<torch::Library>(torch::Library::IMPL, "flashgen", dk, __FILE__,
                                                 __LINE__);
    impl->impl("fwd", std::move(fwd));
    impl->impl("bwd", std::move(bwd));
    libs.push_back(std::move(impl));
  };
  impl_for(c10::DispatchKey::CUDA, torch::CppFunction::makeFromBoxedFunction<&fwd_cuda>(),
           torch::CppFunction::makeFromBoxedFunction<&bwd_cuda>());
  impl_for(c10::DispatchKey::CPU,
           cpu_for_tests ? torch::CppFunction::makeFromBoxedFunction<&fwd_cuda>()
                         : torch::CppFunction::makeFromBoxedFunction<&fwd_python>(),
           cpu_for_tests ? torch::CppFunction::makeFromBoxedFunction<&bwd_cuda>()
                         : torch::CppFunction::makeFromBoxedFunction<&bwd_python>());
  // fwd's gradient is the C++ Function; bwd has none (no double backward), which raises
  // when asked rather than returning a wrong gradient
  impl_for(c10::DispatchKey::Autograd,
           torch::CppFunction::makeFromBoxedFunction<&fwd_autograd>(),
           torch::autograd::autogradNotImplementedFallback());
  g_installed = true;
}

// An inference op in C++ (no gradient): its schema, the fast kernel for CUDA (and CPU in the
// tests), the Python implementation for CPU otherwise, autograd's not-implemented fallback.
void define_inference_op(const char* name, const std::string& schema, torch::CppFunction fast,
                         torch::CppFunction cpu) {
  auto& libs = libraries();
  auto def = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "flashgen",
                                              c10::nullopt, __FILE__, __LINE__);
  def->def(torch::schema(schema.c_str(), c10::AliasAnalysisKind::FROM_SCHEMA));
  libs.push_back(std::move(def));
  auto impl = [&](c10::DispatchKey dk, torch::CppFunction fn) {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "flashgen", dk, __FILE__,
                                                __LINE__);
    lib->impl(name, std::move(fn));
    libs.push_back(std::move(lib));
  };
  impl(c10::DispatchKey::CUDA, std::move(fast));
  impl(c10::DispatchKey::CPU, std::move(cpu));
  impl(c10::DispatchKey::Autograd, torch::autograd::autogradNotImplementedFallback());
}

bool g_decode_installed = false, g_merge_installed = false;

// flashgen::decode in C++ (kvcache.py calls this when the binding is on): no gradient.
void install_decode(py::object plan, py::object python, const std::string& schema,
                    bool cpu_for_tests) {
  TORCH_CHECK(g_installed, "flashgen binding: install() first");
  TORCH_CHECK(!g_decode_installed, "flashgen binding: install_decode() runs once per process");
  g_py->decode_plan = plan;
  g_py->decode_py = python;
  define_inference_op("decode", schema,
                      torch::CppFunction::makeFromBoxedFunction<&decode_cuda>(),
                      cpu_for_tests ? torch::CppFunction::makeFromBoxedFunction<&decode_cuda>()
                                    : torch::CppFunction::makeFromBoxedFunction<&decode_python>());
  g_decode_installed = true;
}

// flashgen::merge_states in C++ (kvcache.py calls this when the binding is on): no gradient.
void install_merge(py::object plan, py::object python, const std::string& schema,
                   bool cpu_for_tests) {
  TORCH_CHECK(g_installed, "flashgen binding: install() first");
  TORCH_CHECK(!g_merge_installed, "flashgen binding: install_merge() runs once per process");
  g_py->merge_plan = plan;
  g_py->merge_py = python;
  define_inference_op("merge_states", schema,
                      torch::CppFunction::makeFromBoxedFunction<&merge_cuda>(),
                      cpu_for_tests ? torch::CppFunction::makeFromBoxedFunction<&merge_cuda>()
                                    : torch::CppFunction::makeFromBoxedFunction<&merge_python>());
  g_merge_installed = true;
}

py::dict stats() {
  py::dict d;
  d["hits"] = g_hits.load(), d["misses"] = g_misses.load(), d["fallbacks"] = g_fallbacks.load();
  return d;
}

void clear() {
  g_merge_plans.clear();
  g_decode_plans.clear();
  g_fwd_plans.clear();
  g_bwd_plans.clear();
  g_backward_ok.clear();
}

py::dict workspace_carve(int64_t batch, int64_t seqlen_q, int64_t heads, int64_t head_dim,
                         int64_t block_m, bool deterministic) {
  const Carve c = carve_workspace(batch, seqlen_q, heads, head_dim, block_m, deterministic);
  py::dict d;
  d["dq_accum"] = c.dq_accum, d["dsum"] = c.dsum, d["bytes"] = c.bytes;
  d["dq_sem"] = c.dq_sem < 0 ? py::object(py::none()) : py::object(py::int_(c.dq_sem));
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashgen.torch's compiled host path (see flashgen.torch.binding)";
  m.def("install", &install, "define flashgen::fwd/bwd with C++ kernels");
  m.def("install_decode", &install_decode, "define flashgen::decode with a C++ kernel");
  m.def("install_merge", &install_merge, "define flashgen::merge_states with a C++ kernel");
  m.def("stats", &stats, "plan-cache hits, misses and Python fallbacks since load");
  m.def("clear", &clear, "forget every plan");
  m.def("workspace_carve", &workspace_carve, "the backward's workspace carve (tests)");
  m.attr("FWD_PARAMS_BYTES") = py::int_(sizeof(fg_fwd_params));
  m.attr("BWD_PARAMS_BYTES") = py::int_(sizeof(fg_bwd_params));
  m.attr("SCORE_PARAMS_BYTES") = py::int_(sizeof(fg_score_params));
  m.attr("CUDA_GENERATOR") = py::bool_(kCudaGenerator);
}
