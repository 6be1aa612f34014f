// A server's ops over every dynamic-table shard it holds (kv_shard.h), one op per rank and step
// instead of a few per shard: the reads of one rank's message, the initial rows computed inside
// (id_hash.h's laws). Shards are found by container and shared name in the device's resource
// manager, made on first use as ParallaxKvShard makes them, so no handle op runs per shard and
// step; the op's `container` attr comes from the graph's container scope, as a handle op's does.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallax_tf/ops/id_hash.h"
#include "parallax_tf/ops/kv_pushes.h"
#include "parallax_tf/ops/kv_server.h"
#include "parallax_tf/ops/kv_shard.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace parallax {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

// Every read of one rank's message to this server: `message` is the reads' id counts, then
// each read's ids. The rows come back flattened, read after read: a live id's row, else its
// initial row (admission on first use) or zeros, as ParallaxKvRead answers each read. With a
// `rank` (>= 0), the read waits, without holding a thread, until the server's boundaries have
// applied every push that rank made to `pushes` (kv_pushes.h).
class KvReadManyOp : public AsyncOpKernel {
 public:
  explicit KvReadManyOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("shared_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("admit_on_first_use", &first_use_));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    const size_t n = names_.size();
    OP_REQUIRES(c, attrs_.dims.size() == n && first_use_.size() == n,
                Invalid("ParallaxKvReadMany: ", n, " shards but ", attrs_.dims.size(), " dims and ", first_use_.size(),
                        " admission flags"));
    OP_REQUIRES(c, rank_ < attrs_.ranks, Invalid("ParallaxKvReadMany: rank ", rank_, " of ", attrs_.ranks));
    OP_REQUIRES_OK(c, ParseLaws(c, "ParallaxKvReadMany", n, &laws_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (rank_ < 0) {
      ctx->SetStatus(Read(ctx));
      done();
      return;
    }
    tensorflow::core::RefCountPtr<KvPushes> pushes;
    OP_REQUIRES_OK_ASYNC(ctx, FindPushes(ctx, attrs_.container, attrs_.pushes, attrs_.ranks, &pushes), done);
    KvPushes* gate = pushes.get();
    // the waiting read's ticket, once known: a cancellation before then finds none to drop
    auto ticket = std::make_shared<std::atomic<int64_t>>(-1);
    tensorflow::CancellationManager* cm = ctx->cancellation_manager();
    const tensorflow::CancellationToken token = cm->get_cancellation_token();
    const bool registered = cm->RegisterCallback(token, [ctx, done, gate, ticket]() {
      const int64_t waiting = ticket->load();
      if (waiting > 0 && gate->CancelRead(waiting)) {
        ctx->SetStatus(absl::CancelledError("ParallaxKvReadMany: the step was cancelled before the boundary the "
                                            "read waits for"));
        done();
      }
    });
    OP_REQUIRES_ASYNC(ctx, registered, absl::CancelledError("ParallaxKvReadMany: the step was cancelled"), done);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    auto read = [this, ctx, done, cm, token]() {
      cm->TryDeregisterCallback(token);
      ctx->SetStatus(Read(ctx));
      done();
    };
    const int64_t waiting = gate->WhenApplied(rank_, [read, workers](bool from_boundary) {
      if (from_boundary) workers->Schedule(read);     // not on the boundary's thread
      else read();
    });
    ticket->store(waiting);
    if (waiting > 0 && cm->IsCancelled() && gate->CancelRead(waiting)) {     // cancelled before the ticket was known
      cm->TryDeregisterCallback(token);
      ctx->SetStatus(absl::CancelledError("ParallaxKvReadMany: the step was cancelled"));
      done();
    }
  }

 private:
  absl::Status Read(OpKernelContext* ctx) {
    const Tensor& message = ctx->input(0);
    const int64_t reads = static_cast<int64_t>(names_.size());
    std::vector<int64_t> begin, count;
    TF_RETURN_IF_ERROR(ParseMessage(message, reads, "ParallaxKvReadMany", &begin, &count));
    const int64_t* counts = message.flat<int64_t>().data();
    int64_t floats = 0;
    for (int64_t k = 0; k < reads; ++k) floats += counts[k] * attrs_.dims[k];
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({floats}), &out));
    const int64_t* id = counts + reads;
    float* rows = out->flat<float>().data();
    std::vector<double> scratch;
    for (int64_t k = 0; k < reads; ++k) {
      tensorflow::core::RefCountPtr<KvShard> shard;
      TF_RETURN_IF_ERROR(FindShard(ctx, attrs_.container, names_[k], attrs_.dims[k], &shard));
      const int64_t dim = attrs_.dims[k];
      scratch.resize(dim);
      absl::ReaderMutexLock l(shard->mu());
      const auto& entries = shard->entries();
      for (int64_t i = 0; i < counts[k]; ++i, ++id, rows += dim) {
        auto it = entries.find(*id);
        if (it != entries.end() && it->second.live)
          std::copy(it->second.data.begin(), it->second.data.begin() + dim, rows);
        else if (first_use_[k]) laws_[k].Row(*id, dim, scratch.data(), rows);
        else std::fill(rows, rows + dim, 0.0f);
      }
    }
    return absl::OkStatus();
  }

  PushesAttrs attrs_;           // its container: from the graph's container scope
  int64_t rank_;
  std::vector<std::string> names_;
  std::vector<bool> first_use_;
  std::vector<RowLaw> laws_;
};

}  // namespace

REGISTER_OP("ParallaxKvReadMany")
    .Input("message: int64")
    .Output("rows: float")
    .Attr("shared_names: list(string) >= 1")
    .Attr("dims: list(int)")
    .Attr("admit_on_first_use: list(bool)")
    .Attr("law_kinds: list(string)")
    .Attr("salts: list(int)")
    .Attr("law_values: tensor")
    .Attr("pushes: string = ''")
    .Attr("rank: int = -1")
    .Attr("ranks: int = 1")
    .Attr("container: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("The rows of every read in one rank's message to a server, flattened in order.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvReadMany").Device(::tensorflow::DEVICE_CPU), KvReadManyOp);

}  // namespace parallax
