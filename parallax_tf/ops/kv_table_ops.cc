// A dynamic table shard's compiled training ops (kv_shard.h): the shard resource, a read (one op
// per shard and step) and the step boundary (one op: the step's summed gradients in; admission,
// last-seen stamps, the optimizer's rule on row and slots, eviction in one pass).
// kv_table_io_ops.cc has the rest: export, import, counters, tracked ids, removal.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallax_tf/ops/kv_shard.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_op_kernel.h"
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
using ShardPtr = tensorflow::core::RefCountPtr<KvShard>;

class KvShardOp : public tensorflow::ResourceOpKernel<KvShard> {
 public:
  explicit KvShardOp(OpKernelConstruction* c) : ResourceOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
  }

 private:
  absl::Status CreateResource(KvShard** resource) override TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *resource = new KvShard(dim_, cinfo_.name());
    return absl::OkStatus();
  }
  absl::Status VerifyResource(KvShard* shard) override {
    if (shard->dim() != dim_)
      return Invalid("dynamic table shard ", shard->name(), " holds rows of ", shard->dim(), "; this op asks for ",
                     dim_);
    return absl::OkStatus();
  }
  int64_t dim_;
};

// Rows of `ids`: a live id's row; another's initial row when admission is on first use, else zeros.
class KvReadOp : public OpKernel {
 public:
  explicit KvReadOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("admit_on_first_use", &admit_on_first_use_));
  }

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const Tensor& ids = ctx->input(1);
    const Tensor& initial = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckIds(ids, "ParallaxKvRead"));
    const int64_t n = ids.NumElements(), dim = shard->dim();
    OP_REQUIRES_OK(ctx, CheckRows(initial, n, dim, "ParallaxKvRead", "initial rows"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    const int64_t* id = ids.flat<int64_t>().data();
    const float* fresh = initial.flat<float>().data();
    float* rows = out->flat<float>().data();
    absl::ReaderMutexLock l(shard->mu());
    auto& entries = shard->entries();
    for (int64_t i = 0; i < n; ++i) {
      auto it = entries.find(id[i]);
      const float* source = nullptr;
      if (it != entries.end() && it->second.live) source = it->second.data.data();
      else if (admit_on_first_use_) source = fresh + i * dim;
      if (source) std::copy(source, source + dim, rows + i * dim);
      else std::fill(rows + i * dim, rows + (i + 1) * dim, 0.0f);
    }
  }

 private:
  bool admit_on_first_use_;
};

// The step's end for the shard (store.Shard.boundary): ids distinct, their gradients summed over
// the ranks, their occurrences in the global batch, their initial rows, the rule's hyper-parameters.
class KvBoundaryOp : public OpKernel {
 public:
  explicit KvBoundaryOp(OpKernelConstruction* c) : OpKernel(c) {
    std::string kind;
    OP_REQUIRES_OK(c, c->GetAttr("kind", &kind));
    OP_REQUIRES(c, ParseRuleKind(kind, &rule_.kind), Invalid("ParallaxKvBoundary: no row rule ", kind));
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &rule_.nesterov));
    OP_REQUIRES_OK(c, c->GetAttr("learning_rate_power", &rule_.learning_rate_power));
    OP_REQUIRES_OK(c, c->GetAttr("admit_after", &admit_after_));
    OP_REQUIRES_OK(c, c->GetAttr("evict_after", &evict_after_));
    OP_REQUIRES_OK(c, c->GetAttr("slot_initial", &slot_initial_));
  }

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const Tensor &ids = ctx->input(1), &grads = ctx->input(2), &counts = ctx->input(3);
    const Tensor &initial = ctx->input(4), &hyper = ctx->input(5);
    const int64_t n = ids.NumElements(), dim = shard->dim();
    OP_REQUIRES_OK(ctx, CheckIds(ids, "ParallaxKvBoundary"));
    OP_REQUIRES_OK(ctx, CheckRows(grads, n, dim, "ParallaxKvBoundary", "gradients"));
    OP_REQUIRES_OK(ctx, CheckRows(initial, n, dim, "ParallaxKvBoundary", "initial rows"));
    OP_REQUIRES(ctx, counts.NumElements() == n, Invalid("ParallaxKvBoundary: ", n, " ids, ", counts.NumElements(),
                                                        " counts"));
    OP_REQUIRES(ctx, hyper.NumElements() == HyperCount(rule_.kind),
                Invalid("ParallaxKvBoundary: the rule takes ", HyperCount(rule_.kind), " hyper-parameters, got ",
                        hyper.NumElements()));
    Rule rule = rule_;
    rule.hyper.assign(hyper.flat<float>().data(), hyper.flat<float>().data() + hyper.NumElements());
    const int64_t* id = ids.flat<int64_t>().data();
    const int64_t* count = counts.flat<int64_t>().data();
    const float* grad = grads.flat<float>().data();
    const float* fresh = initial.flat<float>().data();

    Boundary how{rule, admit_after_, evict_after_, slot_initial_};
    absl::MutexLock l(shard->mu());
    OP_REQUIRES_OK(ctx, how.Run(shard.get(), n, id, grad, count, [&](int64_t i, float* row) {
      std::copy(fresh + i * dim, fresh + (i + 1) * dim, row);
    }));
  }

 private:
  Rule rule_;
  int64_t admit_after_, evict_after_;
  std::vector<float> slot_initial_;
};

}  // namespace

REGISTER_OP("ParallaxKvShard")
    .Output("handle: resource")
    .Attr("dim: int >= 1")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("One shard of a dynamic table: id -> row, slots and bookkeeping, in one hash map.");

REGISTER_OP("ParallaxKvRead")
    .Input("handle: resource")
    .Input("ids: int64")
    .Input("initial: float")
    .Output("rows: float")
    .Attr("admit_on_first_use: bool")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(2));
      return absl::OkStatus();
    })
    .Doc("Each id's live row, else its initial row (admission on first use) or zeros.");

REGISTER_OP("ParallaxKvBoundary")
    .Input("handle: resource")
    .Input("ids: int64")
    .Input("grads: float")
    .Input("counts: int64")
    .Input("initial: float")
    .Input("hyper: float")
    .Attr("kind: string")
    .Attr("nesterov: bool = false")
    .Attr("learning_rate_power: float = -0.5")
    .Attr("admit_after: int >= 1")
    .Attr("evict_after: int = -1")
    .Attr("slot_initial: list(float)")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("The step boundary of a shard: admission, the row rule on rows and slots, stamps, eviction.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvShard").Device(DEVICE_CPU), KvShardOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvRead").Device(DEVICE_CPU), KvReadOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvBoundary").Device(DEVICE_CPU), KvBoundaryOp);

}  // namespace parallax
