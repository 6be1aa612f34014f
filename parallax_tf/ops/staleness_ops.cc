// Staleness-aware asynchronous updates for PS+: one push applied to every variable of a
// parameter-server task, with the learning rate scaled by how many versions the pushing rank's
// copy is behind. Reading the version, scaling, applying (SGD, Momentum, Adagrad or Adam, slots beside
// the variables) and advancing the version happen under the variables' locks in one kernel, so
// two pushes can never read the same version or interleave their updates. A second op reads
// a task's variables together with the version they belong to.
#define EIGEN_USE_THREADS  // training_op_helpers.h copies tensors on the CPU device
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_util.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace parallax {
namespace {

using ::tensorflow::CPUDevice;
using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::Var;
namespace shape_inference = ::tensorflow::shape_inference;

enum class Optimizer { kSgd, kMomentum, kAdagrad, kAdam };
enum class Rule { kNone, kInverse, kExp };

int SlotsPerVariable(Optimizer o) { return o == Optimizer::kSgd ? 0 : (o == Optimizer::kAdam ? 2 : 1); }

// The learning-rate factor of an update computed on a copy `tau` versions old.
double StalenessScale(Rule rule, double gamma, int64_t tau) {
  switch (rule) {
    case Rule::kNone: return 1.0;
    case Rule::kInverse: return 1.0 / static_cast<double>(tau > 1 ? tau : 1);
    case Rule::kExp: return std::pow(gamma, static_cast<double>(tau));
  }
  return 1.0;
}

// Hyperparameters in the variables' type, as TF's apply kernels see them.
template <typename T>
struct Hyper {
  T lr, momentum, beta1, beta2, epsilon;
  bool nesterov;
  T adam_alpha;  // lr * sqrt(1 - beta2^t) / (1 - beta1^t)
};

// Mirrors ResourceApplyGradientDescent / ResourceApplyMomentum / ResourceApplyAdagrad /
// ResourceApplyAdam on `n` elements starting at `w` (and the slots at the same offset).
template <typename T>
void ApplyDense(Optimizer o, const Hyper<T>& h, int64_t n, T* w, T* s0, T* s1, const T* g) {
  if (o == Optimizer::kSgd) {
    for (int64_t j = 0; j < n; ++j) w[j] -= g[j] * h.lr;
  } else if (o == Optimizer::kMomentum) {
    for (int64_t j = 0; j < n; ++j) {
      s0[j] = s0[j] * h.momentum + g[j];
      w[j] -= h.nesterov ? g[j] * h.lr + s0[j] * h.momentum * h.lr : s0[j] * h.lr;
    }
  } else if (o == Optimizer::kAdagrad) {
    for (int64_t j = 0; j < n; ++j) {
      s0[j] += g[j] * g[j];
      w[j] -= g[j] * h.lr * (T(1) / std::sqrt(s0[j]));
    }
  } else {
    const T one(1);
    for (int64_t j = 0; j < n; ++j) {
      s0[j] += (g[j] - s0[j]) * (one - h.beta1);
      s1[j] += (g[j] * g[j] - s1[j]) * (one - h.beta2);
      w[j] -= (s0[j] * h.adam_alpha) / (std::sqrt(s1[j]) + h.epsilon);
    }
  }
}

// Rows `idx[i]` of a [rows, width] variable get row i of `g` (indices already distinct, as the
// tf.compat.v1 optimizers make them). SGD, Momentum and Adagrad touch those rows only; Adam decays its
// moments everywhere and updates every element, as tf.compat.v1.train.AdamOptimizer's sparse
// path does.
template <typename T>
void ApplySparse(Optimizer o, const Hyper<T>& h, int64_t rows, int64_t width, T* w, T* s0, T* s1,
                 const T* g, const int64_t* idx, int64_t k) {
  if (o == Optimizer::kAdam) {
    const T one(1);
    const int64_t n = rows * width;
    for (int64_t j = 0; j < n; ++j) { s0[j] *= h.beta1; s1[j] *= h.beta2; }
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < width; ++j) {
        const T gj = g[i * width + j];
        s0[idx[i] * width + j] += gj * (one - h.beta1);
        s1[idx[i] * width + j] += gj * gj * (one - h.beta2);
      }
    }
    for (int64_t j = 0; j < n; ++j) w[j] -= h.adam_alpha * s0[j] / (std::sqrt(s1[j]) + h.epsilon);
    return;
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t at = idx[i] * width;
    ApplyDense<T>(o, h, width, w + at, s0 ? s0 + at : nullptr, nullptr, g + i * width);
  }
}

// The tensor of resource input `input` ready to update in place, whatever the variable's type
// (TF's optimizers keep Adam's beta powers in float32 next to float64 variables).
absl::Status VariableTensor(OpKernelContext* ctx, int input, bool sparse, Tensor* out) {
  tensorflow::core::RefCountPtr<Var> var;
  TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), &var));
  switch (var->tensor()->dtype()) {
    case tensorflow::DT_FLOAT:
      return tensorflow::GetInputTensorFromVariable<CPUDevice, float>(ctx, input, true, sparse, out);
    case tensorflow::DT_DOUBLE:
      return tensorflow::GetInputTensorFromVariable<CPUDevice, double>(ctx, input, true, sparse, out);
    case tensorflow::DT_INT64:
      return tensorflow::GetInputTensorFromVariable<CPUDevice, int64_t>(ctx, input, true, sparse, out);
    default:
      return Invalid("variable input ", input, " holds ", tensorflow::DataTypeString(var->tensor()->dtype()),
                     "; float32, float64 or int64 expected");
  }
}

template <typename T>
T ReadScalar(const Tensor& t) {
  return t.dtype() == tensorflow::DT_FLOAT ? static_cast<T>(t.scalar<float>()()) : static_cast<T>(t.scalar<double>()());
}

// power *= beta in the power's own type, as the optimizer's _finish does.
template <typename T>
void Advance(Tensor& power, T beta) {
  if (power.dtype() == tensorflow::DT_FLOAT) power.scalar<float>()() *= static_cast<float>(beta);
  else power.scalar<double>()() *= static_cast<double>(beta);
}

template <typename T>
class StaleApplyOp : public OpKernel {
 public:
  explicit StaleApplyOp(OpKernelConstruction* c) : OpKernel(c) {
    std::string optimizer, rule;
    OP_REQUIRES_OK(c, c->GetAttr("N", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("S", &s_));
    OP_REQUIRES_OK(c, c->GetAttr("P", &p_));
    OP_REQUIRES_OK(c, c->GetAttr("sparse", &sparse_));
    OP_REQUIRES_OK(c, c->GetAttr("optimizer", &optimizer));
    OP_REQUIRES_OK(c, c->GetAttr("rule", &rule));
    OP_REQUIRES_OK(c, c->GetAttr("gamma", &gamma_));
    OP_REQUIRES_OK(c, c->GetAttr("use_nesterov", &nesterov_));
    optimizer_ = optimizer == "sgd"        ? Optimizer::kSgd
                 : optimizer == "momentum" ? Optimizer::kMomentum
                 : optimizer == "adagrad"  ? Optimizer::kAdagrad
                                           : Optimizer::kAdam;
    rule_ = rule == "none" ? Rule::kNone : rule == "inverse" ? Rule::kInverse : Rule::kExp;
    OP_REQUIRES(c, static_cast<int>(sparse_.size()) == n_,
                Invalid("sparse has ", sparse_.size(), " entries for ", n_, " variables"));
    OP_REQUIRES(c, s_ == n_ * SlotsPerVariable(optimizer_),
                Invalid(optimizer, " needs ", SlotsPerVariable(optimizer_), " slot(s) per variable: got ", s_,
                        " slots for ", n_, " variables"));
    OP_REQUIRES(c, p_ == (optimizer_ == Optimizer::kAdam ? 2 : 0),
                Invalid(optimizer, " takes ", optimizer_ == Optimizer::kAdam ? 2 : 0, " power variables, got ", p_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int kVersion = 0, kCopyVersion = 1, kLr = 2, kHyper = 3, kVars = 4;
    const int kSlots = kVars + n_, kPowers = kSlots + s_, kGrads = kPowers + p_, kIndices = kGrads + n_;
    // Sparse-updated variables (and their slots) switch to copy-on-read first, as TF's sparse
    // apply kernels do, so an update never copies a whole table that a gather is reading.
    std::vector<bool> sparse_access(kGrads, false);
    if (optimizer_ != Optimizer::kAdam) {
      for (int i = 0; i < n_; ++i) {
        if (!sparse_[i]) continue;
        sparse_access[kVars + i] = true;
        if (optimizer_ != Optimizer::kSgd) sparse_access[kSlots + i] = true;
      }
      for (int input = 0; input < kGrads; ++input) {
        if (!sparse_access[input]) continue;
        tensorflow::core::RefCountPtr<Var> var;
        OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, input), &var));
        OP_REQUIRES_OK(ctx, tensorflow::EnsureSparseVariableAccess<CPUDevice, T>(ctx, var.get()));
      }
    }
    std::vector<int> locked;
    locked.push_back(kVersion);
    for (int input = kVars; input < kGrads; ++input) locked.push_back(input);
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, T>(ctx, true, false, locked);

    Tensor version;
    OP_REQUIRES_OK(ctx, VariableTensor(ctx, kVersion, false, &version));
    OP_REQUIRES(ctx, version.dtype() == tensorflow::DT_INT64 && version.NumElements() == 1,
                Invalid("version must be an int64 scalar variable, got ", version.DebugString()));
    const int64_t global = version.flat<int64_t>()(0);
    const int64_t copy = ctx->input(kCopyVersion).scalar<int64_t>()();
    OP_REQUIRES(ctx, copy <= global,
                Invalid("the pushing rank's copy has version ", copy, ", newer than the global version ", global,
                        ": versions must only come from this task's ParallaxVersionedRead"));
    const int64_t tau = global - copy;

    std::vector<Tensor> vars(n_), slots(s_), powers(p_);
    for (int i = 0; i < n_; ++i) OP_REQUIRES_OK(ctx, VariableTensor(ctx, kVars + i, sparse_access[kVars + i], &vars[i]));
    for (int i = 0; i < s_; ++i) OP_REQUIRES_OK(ctx, VariableTensor(ctx, kSlots + i, sparse_access[kSlots + i], &slots[i]));
    for (int i = 0; i < p_; ++i) {
      OP_REQUIRES_OK(ctx, VariableTensor(ctx, kPowers + i, false, &powers[i]));
      OP_REQUIRES(ctx, powers[i].NumElements() == 1 && (powers[i].dtype() == tensorflow::DT_FLOAT ||
                                                         powers[i].dtype() == tensorflow::DT_DOUBLE),
                  Invalid("power ", i, " must be a float32 or float64 scalar, got ", powers[i].DebugString()));
    }
    const auto want = tensorflow::DataTypeToEnum<T>::value;
    for (int i = 0; i < n_; ++i)
      OP_REQUIRES(ctx, vars[i].dtype() == want, Invalid("variable ", i, " holds ", tensorflow::DataTypeString(vars[i].dtype()),
                                                        ", its gradient ", tensorflow::DataTypeString(want)));
    for (int i = 0; i < s_; ++i)
      OP_REQUIRES(ctx, slots[i].dtype() == want, Invalid("slot ", i, " holds ", tensorflow::DataTypeString(slots[i].dtype()),
                                                         ", its variable ", tensorflow::DataTypeString(want)));
    const int per = SlotsPerVariable(optimizer_);
    for (int i = 0; i < n_; ++i) {
      OP_REQUIRES_OK(ctx, CheckShapes(i, vars[i], ctx->input(kGrads + i), ctx->input(kIndices + i)));
      for (int s = 0; s < per; ++s)
        OP_REQUIRES(ctx, slots[i * per + s].shape() == vars[i].shape(),
                    Invalid("slot ", s, " of variable ", i, " has shape ", slots[i * per + s].shape().DebugString(),
                            ", the variable ", vars[i].shape().DebugString()));
    }

    const Tensor& hyper = ctx->input(kHyper);
    OP_REQUIRES(ctx, hyper.NumElements() == 4,
                Invalid("hyper must be [momentum, beta1, beta2, epsilon], got ", hyper.shape().DebugString()));
    const auto hv = hyper.flat<T>();
    Hyper<T> h{static_cast<T>(ctx->input(kLr).scalar<T>()() * static_cast<T>(StalenessScale(rule_, gamma_, tau))),
               hv(0), hv(1), hv(2), hv(3), nesterov_, T(0)};
    if (optimizer_ == Optimizer::kAdam) {
      const T b1p = ReadScalar<T>(powers[0]), b2p = ReadScalar<T>(powers[1]);
      h.adam_alpha = h.lr * std::sqrt(T(1) - b2p) / (T(1) - b1p);
    }
    for (int i = 0; i < n_; ++i) {
      T* w = vars[i].flat<T>().data();
      T* s0 = per > 0 ? slots[i * per].flat<T>().data() : nullptr;
      T* s1 = per > 1 ? slots[i * per + 1].flat<T>().data() : nullptr;
      const Tensor& grad = ctx->input(kGrads + i);
      if (sparse_[i]) {
        const Tensor& idx = ctx->input(kIndices + i);
        const int64_t rows = vars[i].dim_size(0);
        ApplySparse(optimizer_, h, rows, rows ? vars[i].NumElements() / rows : 0, w, s0, s1, grad.flat<T>().data(),
                    idx.flat<int64_t>().data(), idx.NumElements());
      } else {
        ApplyDense(optimizer_, h, vars[i].NumElements(), w, s0, s1, grad.flat<T>().data());
      }
    }
    if (optimizer_ == Optimizer::kAdam) {
      Advance(powers[0], h.beta1);
      Advance(powers[1], h.beta2);
    }
    version.flat<int64_t>()(0) = global + 1;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = tau;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = global + 1;
  }

 private:
  absl::Status CheckShapes(int i, const Tensor& var, const Tensor& grad, const Tensor& idx) const {
    if (!sparse_[i]) {
      if (grad.shape() != var.shape())
        return Invalid("gradient ", i, " has shape ", grad.shape().DebugString(), ", its variable ",
                       var.shape().DebugString());
      return absl::OkStatus();
    }
    if (var.dims() < 1 || idx.dims() != 1 || grad.dims() != var.dims() || grad.dim_size(0) != idx.dim_size(0))
      return Invalid("sparse gradient ", i, ": values ", grad.shape().DebugString(), " and indices ",
                     idx.shape().DebugString(), " do not fit variable ", var.shape().DebugString());
    for (int d = 1; d < var.dims(); ++d)
      if (grad.dim_size(d) != var.dim_size(d))
        return Invalid("sparse gradient ", i, ": rows of ", grad.shape().DebugString(), " do not match variable ",
                       var.shape().DebugString());
    const auto flat = idx.flat<int64_t>();
    for (int64_t k = 0; k < flat.size(); ++k)
      if (flat(k) < 0 || flat(k) >= var.dim_size(0))
        return Invalid("sparse gradient ", i, ": index ", flat(k), " outside [0, ", var.dim_size(0), ")");
    return absl::OkStatus();
  }

  int n_, s_, p_;
  std::vector<bool> sparse_;
  Optimizer optimizer_;
  Rule rule_;
  float gamma_;
  bool nesterov_;
};

// The version of a task and its variables' values at that version (copies taken under the
// locks, so no update can land between reading the version and reading a value).
class VersionedReadOp : public OpKernel {
 public:
  explicit VersionedReadOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES(c, c->num_outputs() == c->num_inputs(),
                Invalid("dtypes has ", c->num_outputs() - 1, " entries for ", c->num_inputs() - 1, " variables"));
  }

  void Compute(OpKernelContext* ctx) override {
    std::vector<int> locked;
    for (int input = 0; input < ctx->num_inputs(); ++input) locked.push_back(input);
    auto locks = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(ctx, true, false, locked);
    for (int input = 0; input < ctx->num_inputs(); ++input) {
      tensorflow::core::RefCountPtr<Var> var;
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, input), &var));
      OP_REQUIRES(ctx, var->tensor()->IsInitialized(),
                  absl::FailedPreconditionError(absl::StrCat("variable ", input, " of ParallaxVersionedRead is not initialised")));
      OP_REQUIRES(ctx, var->tensor()->dtype() == output_type(input),
                  Invalid("variable ", input, " holds ", tensorflow::DataTypeString(var->tensor()->dtype()),
                          ", the op was built for ", tensorflow::DataTypeString(output_type(input))));
      // A deep copy: an update after the locks are released must not show through.
      ctx->set_output(input, tensorflow::tensor::DeepCopy(*var->tensor()));
    }
  }
};

absl::Status ScalarOutputs(shape_inference::InferenceContext* c) {
  c->set_output(0, c->Scalar());
  c->set_output(1, c->Scalar());
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("ParallaxStaleApply")
    .Input("version: resource")
    .Input("copy_version: int64")
    .Input("lr: T")
    .Input("hyper: T")  // [momentum, beta1, beta2, epsilon], in the variables' type as TF's kernels take them
    .Input("vars: N * resource")
    .Input("slots: S * resource")
    .Input("powers: P * resource")
    .Input("grads: N * T")
    .Input("indices: N * int64")
    .Output("staleness: int64")
    .Output("applied_version: int64")
    .Attr("T: {float, double}")
    .Attr("N: int >= 1")
    .Attr("S: int >= 0")
    .Attr("P: int >= 0")
    .Attr("sparse: list(bool)")
    .Attr("optimizer: {'sgd', 'momentum', 'adagrad', 'adam'}")
    .Attr("rule: {'none', 'inverse', 'exp'} = 'inverse'")
    .Attr("gamma: float = 0.9")
    .Attr("use_nesterov: bool = false")
    .SetIsStateful()
    .SetShapeFn(ScalarOutputs)
    .Doc("Applies one push to a task's variables with lr scaled by the staleness, atomically.");

REGISTER_OP("ParallaxVersionedRead")
    .Input("version: resource")
    .Input("vars: N * resource")
    .Output("version_value: int64")
    .Output("values: dtypes")
    .Attr("N: int >= 0")
    .Attr("dtypes: list(type)")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->UnknownShape());
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("A task's version and its variables' values at that version, read under their locks.");

REGISTER_KERNEL_BUILDER(Name("ParallaxStaleApply").Device(DEVICE_CPU).TypeConstraint<float>("T"), StaleApplyOp<float>);
REGISTER_KERNEL_BUILDER(Name("ParallaxStaleApply").Device(DEVICE_CPU).TypeConstraint<double>("T"), StaleApplyOp<double>);
REGISTER_KERNEL_BUILDER(Name("ParallaxVersionedRead").Device(DEVICE_CPU), VersionedReadOp);

}  // namespace parallax
