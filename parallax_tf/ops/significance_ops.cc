// Significance selection for Slim-DP: the core set (largest |w| + lambda |u|, O(n) partial
// selection) and an explored set drawn from a seed every rank shares, so no indices need to
// cross the network. Both ops are deterministic functions of their inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace parallax {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

// splitmix64: a counter-based generator, identical on every platform (tests reimplement it).
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Uniform integer in [0, bound) from draw number `counter` of the stream (seed, round).
inline uint64_t Draw(uint64_t seed, uint64_t round, uint64_t counter, uint64_t bound) {
  const uint64_t key = SplitMix64(seed ^ SplitMix64(round ^ 0xD1B54A32D192ED03ULL));
  return SplitMix64(key + counter) % bound;
}

// Robert Floyd's sampling: `count` distinct positions of [0, m) in O(count), marked in a bitmap
// (m / 8 bytes) whose set bits, read in order, are the positions ascending without a sort; then
// mapped to the indices of [0, n) that are not in the sorted `core`. Output ascending.
void Explore(const int32_t* core, int64_t core_size, int64_t n, int64_t count, uint64_t seed,
             uint64_t round, int32_t* out) {
  const int64_t m = n - core_size;
  std::vector<uint64_t> chosen((m + 63) / 64, 0);
  auto taken = [&chosen](int64_t t) { return (chosen[t >> 6] >> (t & 63)) & 1; };
  for (int64_t j = m - count, k = 0; j < m; ++j, ++k) {
    int64_t t = static_cast<int64_t>(Draw(seed, round, k, j + 1));
    if (taken(t)) t = j;    // j itself was never drawable before: Floyd's step
    chosen[t >> 6] |= uint64_t{1} << (t & 63);
  }
  // position p of the complement is index p + (number of core indices <= that index)
  int64_t c = 0, i = 0;
  for (int64_t word = 0; word < static_cast<int64_t>(chosen.size()); ++word) {
    for (uint64_t bits = chosen[word]; bits; bits &= bits - 1) {
      const int64_t position = word * 64 + __builtin_ctzll(bits);
      int64_t index = position + c;
      while (c < core_size && core[c] <= index) {
        ++c;
        index = position + c;
      }
      out[i++] = static_cast<int32_t>(index);
    }
  }
}

template <typename T>
class SignificanceSelectOp : public OpKernel {
 public:
  explicit SignificanceSelectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("core_size", &core_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("explore_size", &explore_size_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& weights = ctx->input(0);
    const Tensor& update = ctx->input(1);
    const float lambda = ctx->input(2).scalar<float>()();
    const uint64_t seed = static_cast<uint64_t>(ctx->input(3).scalar<int64_t>()());
    const uint64_t round = static_cast<uint64_t>(ctx->input(4).scalar<int64_t>()());
    const int64_t n = weights.NumElements();
    OP_REQUIRES(ctx, update.NumElements() == n,
                Invalid("ParallaxSignificanceSelect: weights have ", n, " elements but update has ",
                                update.NumElements()));
    OP_REQUIRES(ctx, core_size_ + explore_size_ <= n,
                Invalid("ParallaxSignificanceSelect: core_size ", core_size_, " + explore_size ",
                                explore_size_, " exceeds the ", n, " elements"));
    OP_REQUIRES(ctx, n <= INT32_MAX, Invalid("ParallaxSignificanceSelect: more than 2^31 elements"));
    Tensor* core_out = nullptr;
    Tensor* explored_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({core_size_}), &core_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({explore_size_}), &explored_out));
    int32_t* core = core_out->flat<int32_t>().data();
    if (core_size_ == n) {
      for (int64_t i = 0; i < n; ++i) core[i] = static_cast<int32_t>(i);
    } else if (core_size_ > 0) {
      const T* w = weights.flat<T>().data();
      const T* u = update.flat<T>().data();
      std::vector<T> score(n);
      for (int64_t i = 0; i < n; ++i) score[i] = std::abs(w[i]) + static_cast<T>(lambda) * std::abs(u[i]);
      // The core_size-th largest score by nth_element on a copy of the scores (contiguous, no
      // indirection), then one ascending pass: every score above it, and of the scores equal to
      // it the lowest indices (deterministic ties). Output ascending without a sort.
      std::vector<T> ranked(score);
      std::nth_element(ranked.begin(), ranked.begin() + (core_size_ - 1), ranked.end(), std::greater<T>());
      const T threshold = ranked[core_size_ - 1];
      int64_t ties = core_size_;
      for (int64_t i = 0; i < n; ++i) ties -= score[i] > threshold;
      for (int64_t i = 0, k = 0; i < n && k < core_size_; ++i) {
        if (score[i] > threshold || (score[i] == threshold && ties-- > 0)) core[k++] = static_cast<int32_t>(i);
      }
    }
    Explore(core, core_size_, n, explore_size_, seed, round, explored_out->flat<int32_t>().data());
  }

 private:
  int64_t core_size_;
  int64_t explore_size_;
};

// The explored set of a round (Merged = false), or the round's whole selection, core and
// explored merged ascending (Merged = true), for a core set every rank and the PS share.
template <bool Merged>
class ExploreIndicesOp : public OpKernel {
 public:
  explicit ExploreIndicesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("explore_size", &explore_size_));
  }

  void Compute(OpKernelContext* ctx) override {
    const char* op = Merged ? "ParallaxRoundSelection" : "ParallaxExploreIndices";
    const Tensor& core = ctx->input(0);
    const uint64_t seed = static_cast<uint64_t>(ctx->input(1).scalar<int64_t>()());
    const uint64_t round = static_cast<uint64_t>(ctx->input(2).scalar<int64_t>()());
    OP_REQUIRES(ctx, core.dims() == 1, Invalid(op, ": core must be a vector"));
    const int64_t c = core.NumElements();
    const int32_t* idx = core.flat<int32_t>().data();
    for (int64_t i = 0; i < c; ++i) {
      OP_REQUIRES(ctx, idx[i] >= 0 && idx[i] < n_ && (i == 0 || idx[i - 1] < idx[i]),
                  Invalid(op, ": core must be sorted, unique and in [0, ", n_, "); position ", i, " holds ",
                          idx[i]));
    }
    OP_REQUIRES(ctx, c + explore_size_ <= n_,
                Invalid(op, ": ", c, " core + ", explore_size_, " explored exceeds the ", n_, " elements"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({Merged ? c + explore_size_ : explore_size_}), &out));
    int32_t* result = out->flat<int32_t>().data();
    if (!Merged) {
      Explore(idx, c, n_, explore_size_, seed, round, result);
      return;
    }
    std::vector<int32_t> explored(explore_size_);
    Explore(idx, c, n_, explore_size_, seed, round, explored.data());
    std::merge(idx, idx + c, explored.begin(), explored.end(), result);    // disjoint, both ascending
  }

 private:
  int64_t n_;
  int64_t explore_size_;
};

}  // namespace

REGISTER_OP("ParallaxSignificanceSelect")
    .Input("weights: T")
    .Input("update: T")
    .Input("lambda: float")
    .Input("seed: int64")
    .Input("round: int64")
    .Output("core: int32")
    .Output("explored: int32")
    .Attr("T: {float, double}")
    .Attr("core_size: int >= 0")
    .Attr("explore_size: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t core_size, explore_size;
      TF_RETURN_IF_ERROR(c->GetAttr("core_size", &core_size));
      TF_RETURN_IF_ERROR(c->GetAttr("explore_size", &explore_size));
      c->set_output(0, c->Vector(core_size));
      c->set_output(1, c->Vector(explore_size));
      return absl::OkStatus();
    })
    .Doc("Core set (largest |w| + lambda |u|, ascending) and explored set (uniform over the rest).");

REGISTER_OP("ParallaxExploreIndices")
    .Input("core: int32")
    .Input("seed: int64")
    .Input("round: int64")
    .Output("explored: int32")
    .Attr("n: int >= 0")
    .Attr("explore_size: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t explore_size;
      TF_RETURN_IF_ERROR(c->GetAttr("explore_size", &explore_size));
      c->set_output(0, c->Vector(explore_size));
      return absl::OkStatus();
    })
    .Doc("The explored set ParallaxSignificanceSelect draws for this core set, seed and round.");

REGISTER_OP("ParallaxRoundSelection")
    .Input("core: int32")
    .Input("seed: int64")
    .Input("round: int64")
    .Output("selected: int32")
    .Attr("n: int >= 0")
    .Attr("explore_size: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t explore_size;
      TF_RETURN_IF_ERROR(c->GetAttr("explore_size", &explore_size));
      shape_inference::ShapeHandle core;
      shape_inference::DimensionHandle size;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &core));
      TF_RETURN_IF_ERROR(c->Add(c->Dim(core, 0), explore_size, &size));
      c->set_output(0, c->Vector(size));
      return absl::OkStatus();
    })
    .Doc("A round's selection: the core set and the explored set ParallaxExploreIndices draws, merged ascending.");

REGISTER_KERNEL_BUILDER(
    Name("ParallaxSignificanceSelect").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    SignificanceSelectOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("ParallaxSignificanceSelect").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    SignificanceSelectOp<double>);
REGISTER_KERNEL_BUILDER(Name("ParallaxExploreIndices").Device(DEVICE_CPU), ExploreIndicesOp<false>);
REGISTER_KERNEL_BUILDER(Name("ParallaxRoundSelection").Device(DEVICE_CPU), ExploreIndicesOp<true>);

}  // namespace parallax
