// The input stash of a DSP pipeline stage: the stage input of every batch in flight, kept until
// backward recomputes that batch's forward. Backward must get the input of its own batch and no
// other; a schedule bug that took a neighbour's input would train silently on the wrong data.
// So the storage and the check live in one kernel: a take compares the batch under the stash's
// lock and removes the entry only if it is the right one, and an error leaves the stash as it was.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "parallax_tf/ops/op_errors.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace parallax {
namespace {

using ::tensorflow::DataTypeVector;
using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

// A FIFO because the stages of DSP run backward in the order they ran forward: the oldest entry
// is always the one the next backward needs, and any other batch means the schedule broke.
class StashResource : public tensorflow::ResourceBase {
 public:
  StashResource(DataTypeVector dtypes, int64_t capacity, int64_t stage)
      : dtypes_(std::move(dtypes)), capacity_(capacity), stage_(stage) {}

  std::string DebugString() const override { return absl::StrCat("ParallaxInputStash of stage ", stage_); }

  const DataTypeVector& dtypes() const { return dtypes_; }
  int64_t capacity() const { return capacity_; }
  int64_t stage() const { return stage_; }

  // Tensors are held by value: inputs are immutable and refcounted, and while we hold a reference
  // no later op can forward the buffer and write into it, so no copy is needed.
  absl::Status Put(int64_t batch, std::vector<Tensor> values) {
    absl::MutexLock l(&mu_);
    if (static_cast<int64_t>(entries_.size()) >= capacity_)
      return Invalid("stage ", stage_, ": cannot store the input of batch ", batch, ": the stash is full (capacity ",
                     capacity_, ", stored ", entries_.size(), ": ", StoredLocked(), ")");
    // Increasing across takes too: a batch id seen twice is a schedule bug even if the first was taken.
    if (any_put_ && batch <= last_put_)
      return Invalid("stage ", stage_, ": cannot store the input of batch ", batch,
                     ": batches must increase, and batch ", last_put_, " was stored before");
    entries_.emplace_back(batch, std::move(values));
    last_put_ = batch;
    any_put_ = true;
    return absl::OkStatus();
  }

  absl::Status Take(int64_t batch, std::vector<Tensor>* values) {
    absl::MutexLock l(&mu_);
    if (entries_.empty())
      return Invalid("stage ", stage_, ": backward of batch ", batch,
                     " needs its stored input, but no input is stored");
    if (entries_.front().first != batch)
      return Invalid("stage ", stage_, ": backward of batch ", batch,
                     " needs its stored input, but the oldest stored input is of batch ", entries_.front().first,
                     " (stored: ", StoredLocked(), "); the pipeline schedule is broken");
    *values = std::move(entries_.front().second);
    entries_.pop_front();
    return absl::OkStatus();
  }

  std::vector<int64_t> Batches() const {
    absl::MutexLock l(&mu_);
    return BatchesLocked();
  }

  absl::Status CheckDtypes(const DataTypeVector& got) const {
    if (got == dtypes_) return absl::OkStatus();
    return Invalid("stage ", stage_, ": the stash holds [", tensorflow::DataTypeVectorString(dtypes_),
                   "], the op was built for [", tensorflow::DataTypeVectorString(got), "]");
  }

 private:
  std::vector<int64_t> BatchesLocked() const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<int64_t> batches;
    for (const auto& e : entries_) batches.push_back(e.first);
    return batches;
  }
  // What the stash holds, for error messages: the batches tell which schedule step went wrong.
  std::string StoredLocked() const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::StrCat("[", absl::StrJoin(BatchesLocked(), ", "), "]");
  }

  const DataTypeVector dtypes_;
  const int64_t capacity_, stage_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<int64_t, std::vector<Tensor>>> entries_ TF_GUARDED_BY(mu_);
  int64_t last_put_ TF_GUARDED_BY(mu_) = 0;
  bool any_put_ TF_GUARDED_BY(mu_) = false;
};

class InputStashOp : public tensorflow::ResourceOpKernel<StashResource> {
 public:
  explicit InputStashOp(OpKernelConstruction* c) : ResourceOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("dtypes", &dtypes_));
    OP_REQUIRES_OK(c, c->GetAttr("capacity", &capacity_));
    OP_REQUIRES_OK(c, c->GetAttr("stage", &stage_));
  }

 private:
  absl::Status CreateResource(StashResource** resource) override TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *resource = new StashResource(dtypes_, capacity_, stage_);
    return absl::OkStatus();
  }

  // Two graphs sharing a stash by shared_name must agree on what it holds.
  absl::Status VerifyResource(StashResource* stash) override {
    TF_RETURN_IF_ERROR(stash->CheckDtypes(dtypes_));
    if (stash->capacity() != capacity_)
      return Invalid("stage ", stage_, ": a stash with this shared_name has capacity ", stash->capacity(),
                     ", this op asks for ", capacity_);
    return absl::OkStatus();
  }

  DataTypeVector dtypes_;
  int64_t capacity_, stage_;
};

// Put (no outputs) and Take share their checks: the op was built for the stash's dtypes, and
// the batch is a scalar.
class StashAccessOp : public OpKernel {
 public:
  explicit StashAccessOp(OpKernelConstruction* c) : OpKernel(c) { OP_REQUIRES_OK(c, c->GetAttr("dtypes", &dtypes_)); }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<StashResource> stash;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &stash));
    OP_REQUIRES_OK(ctx, stash->CheckDtypes(dtypes_));
    const Tensor& batch = ctx->input(1);
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(batch.shape()),
                Invalid("stage ", stash->stage(), ": batch must be a scalar, got shape ", batch.shape().DebugString()));
    std::vector<Tensor> values;
    if (ctx->num_outputs() == 0) {
      for (int i = 2; i < ctx->num_inputs(); ++i) values.push_back(ctx->input(i));
      OP_REQUIRES_OK(ctx, stash->Put(batch.scalar<int64_t>()(), std::move(values)));
      return;
    }
    OP_REQUIRES_OK(ctx, stash->Take(batch.scalar<int64_t>()(), &values));
    for (size_t i = 0; i < values.size(); ++i) ctx->set_output(i, values[i]);
  }

 private:
  DataTypeVector dtypes_;
};

// ParallaxStashSize and ParallaxStashBatches.
class StashBatchesOp : public OpKernel {
 public:
  explicit StashBatchesOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<StashResource> stash;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &stash));
    const std::vector<int64_t> batches = stash->Batches();
    const int64_t n = static_cast<int64_t>(batches.size());
    const bool size_only = type_string() == "ParallaxStashSize";
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, size_only ? TensorShape({}) : TensorShape({n}), &out));
    if (size_only) out->scalar<int64_t>()() = n;
    else std::copy(batches.begin(), batches.end(), out->flat<int64_t>().data());
  }
};

// Put and Take: the batch is a scalar.
absl::Status ScalarBatch(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle unused;
  return c->WithRank(c->input(1), 0, &unused);
}

}  // namespace

REGISTER_OP("ParallaxInputStash")
    .Output("handle: resource")
    .Attr("dtypes: list(type) >= 1")
    .Attr("capacity: int >= 1")
    .Attr("stage: int")  // only for messages
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("A pipeline stage's FIFO of (batch, stage input) for the batches in flight.");

REGISTER_OP("ParallaxStashPut")
    .Input("handle: resource")
    .Input("batch: int64")
    .Input("values: dtypes")
    .Attr("dtypes: list(type) >= 1")
    .SetIsStateful()
    .SetShapeFn(ScalarBatch)
    .Doc("Stores the input of `batch`, which must follow every batch stored before.");

REGISTER_OP("ParallaxStashTake")
    .Input("handle: resource")
    .Input("batch: int64")
    .Output("values: dtypes")
    .Attr("dtypes: list(type) >= 1")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {  // the Python wrapper sets the shapes put
      TF_RETURN_IF_ERROR(ScalarBatch(c));
      return shape_inference::UnknownShape(c);
    })
    .Doc("Removes and returns the oldest stored input, which must be of `batch`.");

// Both for checking that the pipeline drained; batches oldest first.
REGISTER_OP("ParallaxStashSize").Input("handle: resource").Output("size: int64").SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape);
REGISTER_OP("ParallaxStashBatches").Input("handle: resource").Output("batches: int64").SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("ParallaxInputStash").Device(DEVICE_CPU), InputStashOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxStashPut").Device(DEVICE_CPU), StashAccessOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxStashTake").Device(DEVICE_CPU), StashAccessOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxStashSize").Device(DEVICE_CPU), StashBatchesOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxStashBatches").Device(DEVICE_CPU), StashBatchesOp);

}  // namespace parallax
