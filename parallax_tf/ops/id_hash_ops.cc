// A dynamic table's per-id uniforms and owners (id_hash.h) as ops: one kernel each for what is
// ~25 and ~10 graph ops in TensorFlow's own bitwise ops, which a served model still uses
// (standard ops only): the same integers, so the same doubles and the same owners.
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

// The shard (int32 in [0, shards)) owning each id: splitmix64(id + golden) mod shards.
class IdOwnerOp : public OpKernel {
 public:
  explicit IdOwnerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shards", &shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ids.shape(), &out));
    const int64_t* id = ids.flat<int64_t>().data();
    int32_t* owner = out->flat<int32_t>().data();
    const uint64_t shards = static_cast<uint64_t>(shards_);
    for (int64_t i = 0; i < ids.NumElements(); ++i)
      owner[i] = static_cast<int32_t>(Owner(id[i], shards));
  }

 private:
  int64_t shards_;
};

}  // namespace

REGISTER_OP("ParallaxIdOwner")
    .Input("ids: int64")
    .Output("owner: int32")
    .Attr("shards: int >= 1")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("The shard owning each id: splitmix64(id + golden) mod shards.");

REGISTER_KERNEL_BUILDER(Name("ParallaxIdOwner").Device(::tensorflow::DEVICE_CPU), IdOwnerOp);

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
