// Writes values at flat positions of a resource variable of any shape: the pull of a Slim-DP
// round puts the global copy's selected coordinates into a rank's replica. Stock TF needs
// UnravelIndex + Transpose + ResourceScatterNdUpdate (rank-many int64 per coordinate) or a
// read, copy and assign of the whole variable for the same thing.
#define EIGEN_USE_THREADS  // training_op_helpers.h copies tensors on the CPU device
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace parallax {
namespace {

using ::tensorflow::CPUDevice;
using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::Var;

template <typename T>
class FlatScatterUpdateOp : public OpKernel {
 public:
  explicit FlatScatterUpdateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(1);
    const Tensor& updates = ctx->input(2);
    OP_REQUIRES(ctx, indices.dims() == 1 && updates.dims() == 1 && indices.NumElements() == updates.NumElements(),
                Invalid("ParallaxFlatScatterUpdate: indices and updates must be vectors of one length, got ",
                        indices.shape().DebugString(), " and ", updates.shape().DebugString()));
    tensorflow::core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    OP_REQUIRES(ctx, var->tensor()->dtype() == tensorflow::DataTypeToEnum<T>::v(),
                Invalid("ParallaxFlatScatterUpdate: the variable holds ",
                        tensorflow::DataTypeString(var->tensor()->dtype()), ", the updates ",
                        tensorflow::DataTypeString(tensorflow::DataTypeToEnum<T>::v())));
    OP_REQUIRES(ctx, var->is_initialized,
                absl::FailedPreconditionError("ParallaxFlatScatterUpdate: the variable is not initialized"));
    // Written like a dense update (TF's Assign*VariableOp): under the exclusive lock, the buffer
    // copied first only if a read still holds it. Not EnsureSparseVariableAccess, as TF's
    // scatter kernels do: that turns the variable copy-on-read for good, and then every read and
    // every dense apply of it (the model's forward pass and optimizer) copies the whole tensor.
    tensorflow::mutex_lock lock(*var->mu());
    OP_REQUIRES_OK(ctx, (tensorflow::PrepareToUpdateVariable<CPUDevice, T>(ctx, var->tensor(),
                                                                          var->copy_on_read_mode.load())));
    auto flat = var->tensor()->flat<T>();
    const int64_t n = flat.size(), k = indices.NumElements();
    const int32_t* idx = indices.flat<int32_t>().data();
    for (int64_t i = 0; i < k; ++i) {    // all checked first: an error writes nothing
      OP_REQUIRES(ctx, idx[i] >= 0 && idx[i] < n,
                  Invalid("ParallaxFlatScatterUpdate: index ", idx[i], " at position ", i, " is outside [0, ", n,
                          ") of the variable"));
    }
    const T* values = updates.flat<T>().data();
    T* out = flat.data();
    for (int64_t i = 0; i < k; ++i) out[idx[i]] = values[i];
  }
};

}  // namespace

REGISTER_OP("ParallaxFlatScatterUpdate")
    .Input("resource: resource")
    .Input("indices: int32")
    .Input("updates: T")
    .Attr("T: {float, double}")
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc("variable.flat[indices[i]] = updates[i], whatever the variable's shape.");

REGISTER_KERNEL_BUILDER(Name("ParallaxFlatScatterUpdate").Device(DEVICE_CPU).TypeConstraint<float>("T"),
                        FlatScatterUpdateOp<float>);
REGISTER_KERNEL_BUILDER(Name("ParallaxFlatScatterUpdate").Device(DEVICE_CPU).TypeConstraint<double>("T"),
                        FlatScatterUpdateOp<double>);

}  // namespace parallax
