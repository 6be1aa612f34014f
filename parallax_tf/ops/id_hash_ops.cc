// A dynamic table's per-id uniforms (id_hash.h) as an op: one kernel for what is ~25 graph ops
// in TensorFlow's own bitwise ops, which a served model still uses (standard ops only): the
// same integers, so the same doubles.
#include <cstdint>

#include "parallax_tf/ops/id_hash.h"
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
    for (int64_t i = 0; i < n; ++i) IdUniforms(id[i], salt_, dim_, u + i * dim_);
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
