// A server's ops over every dynamic-table shard it holds (kv_shard.h), one op per rank and step
// instead of a few per shard: the reads of one rank's message, the initial rows computed inside
// (id_hash.h's laws). Shards are found by container and shared name in the device's resource
// manager, made on first use as ParallaxKvShard makes them, so no handle op runs per shard and
// step; the op's `container` attr comes from the graph's container scope, as a handle op's does.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallax_tf/ops/id_hash.h"
#include "parallax_tf/ops/kv_server.h"
#include "parallax_tf/ops/kv_shard.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace parallax {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

// Every read of one rank's message to this server: `message` is the reads' id counts, then
// each read's ids; `laws` [reads, 2] the doubles of each read's initial row law. The rows come
// back flattened, read after read: a live id's row, else its initial row (admission on first
// use) or zeros, as ParallaxKvRead answers each read.
class KvReadManyOp : public OpKernel {
 public:
  explicit KvReadManyOp(OpKernelConstruction* c) : OpKernel(c) {
    std::vector<std::string> laws;
    std::vector<int64_t> salts;
    OP_REQUIRES_OK(c, c->GetAttr("container", &container_));
    OP_REQUIRES_OK(c, c->GetAttr("shared_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_));
    OP_REQUIRES_OK(c, c->GetAttr("admit_on_first_use", &first_use_));
    OP_REQUIRES_OK(c, c->GetAttr("law_kinds", &laws));
    OP_REQUIRES_OK(c, c->GetAttr("salts", &salts));
    const size_t n = names_.size();
    OP_REQUIRES(c, dims_.size() == n && first_use_.size() == n && laws.size() == n && salts.size() == n,
                Invalid("ParallaxKvReadMany: ", n, " shards but ", dims_.size(), " dims, ", first_use_.size(),
                        " admission flags, ", laws.size(), " laws and ", salts.size(), " salts"));
    laws_.resize(n);
    for (size_t k = 0; k < n; ++k) {
      OP_REQUIRES(c, RowLaw::Parse(laws[k], &laws_[k].kind), Invalid("ParallaxKvReadMany: no row law ", laws[k]));
      laws_[k].salt = static_cast<uint64_t>(salts[k]);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& message = ctx->input(0);
    const Tensor& law_values = ctx->input(1);
    const int64_t reads = static_cast<int64_t>(names_.size());
    std::vector<int64_t> begin, count;
    OP_REQUIRES_OK(ctx, ParseMessage(message, reads, "ParallaxKvReadMany", &begin, &count));
    OP_REQUIRES_OK(ctx, CheckRows(law_values, reads, 2, "ParallaxKvReadMany", "law values"));
    const int64_t* counts = message.flat<int64_t>().data();
    const double* law = law_values.flat<double>().data();
    int64_t floats = 0;
    for (int64_t k = 0; k < reads; ++k) floats += counts[k] * dims_[k];
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({floats}), &out));
    const int64_t* id = counts + reads;
    float* rows = out->flat<float>().data();
    std::vector<double> scratch;
    for (int64_t k = 0; k < reads; ++k) {
      tensorflow::core::RefCountPtr<KvShard> shard;
      OP_REQUIRES_OK(ctx, FindShard(ctx, container_, names_[k], dims_[k], &shard));
      RowLaw row_law = laws_[k];
      row_law.a = law[2 * k];
      row_law.b = law[2 * k + 1];
      const int64_t dim = dims_[k];
      scratch.resize(dim);
      absl::ReaderMutexLock l(shard->mu());
      const auto& entries = shard->entries();
      for (int64_t i = 0; i < counts[k]; ++i, ++id, rows += dim) {
        auto it = entries.find(*id);
        if (it != entries.end() && it->second.live)
          std::copy(it->second.data.begin(), it->second.data.begin() + dim, rows);
        else if (first_use_[k]) row_law.Row(*id, dim, scratch.data(), rows);
        else std::fill(rows, rows + dim, 0.0f);
      }
    }
  }

 private:
  std::string container_;     // set from the graph's container scope, as a handle op's is
  std::vector<std::string> names_;
  std::vector<int64_t> dims_;
  std::vector<bool> first_use_;
  std::vector<RowLaw> laws_;
};

}  // namespace

REGISTER_OP("ParallaxKvReadMany")
    .Input("message: int64")
    .Input("laws: double")
    .Output("rows: float")
    .Attr("shared_names: list(string) >= 1")
    .Attr("dims: list(int)")
    .Attr("admit_on_first_use: list(bool)")
    .Attr("law_kinds: list(string)")
    .Attr("salts: list(int)")
    .Attr("container: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("The rows of every read in one rank's message to a server, flattened in order.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvReadMany").Device(::tensorflow::DEVICE_CPU), KvReadManyOp);

}  // namespace parallax
