// A dynamic table's per-id uniforms (parallax_tf/dynamic/ids.py): element j of id i is
// splitmix64(splitmix64(i ^ salt) + (j + 1) * golden) >> 11, scaled to [0, 1). One kernel for
// what is ~25 graph ops in TensorFlow's own bitwise ops, which a served model still uses
// (standard ops only): the same integers, so the same doubles.
#include <cstdint>

#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace parallax {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

class IdUniformOp : public OpKernel {
 public:
  explicit IdUniformOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    int64_t salt;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("salt", &salt));
    salt_ = static_cast<uint64_t>(salt);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    OP_REQUIRES(ctx, ids.dims() == 1, Invalid("ParallaxIdUniform: ids must be a vector, got ",
                                              ids.shape().DebugString()));
    const int64_t n = ids.NumElements();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({n, dim_}), &out));
    const int64_t* id = ids.flat<int64_t>().data();
    double* u = out->flat<double>().data();
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t base = Mix(static_cast<uint64_t>(id[i]) ^ salt_);
      for (int64_t j = 0; j < dim_; ++j) {
        const uint64_t bits = Mix(base + static_cast<uint64_t>(j + 1) * kGolden);
        u[i * dim_ + j] = static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
      }
    }
  }

 private:
  int64_t dim_;
  uint64_t salt_;
};

}  // namespace

REGISTER_OP("ParallaxIdUniform")
    .Input("ids: int64")
    .Output("uniform: double")
    .Attr("dim: int >= 1")
    .Attr("salt: int")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), dim));
      return absl::OkStatus();
    })
    .Doc("[len(ids), dim] doubles in [0, 1), each a hash of (salt, id, column).");

REGISTER_KERNEL_BUILDER(Name("ParallaxIdUniform").Device(::tensorflow::DEVICE_CPU), IdUniformOp);

}  // namespace parallax
