// A server's step for every dynamic-table shard it holds, one op per rank (its push) and one
// for rank 0 (the boundary), instead of an accumulator, a take and a boundary per shard:
// - ParallaxKvPush stores one rank's push (per shard: its distinct ids; one payload of their
//   gradient rows and occurrences) in the server's KvPushes;
// - ParallaxKvPushAll stores every rank's push at once, from their concatenation (a replicated
//   table: each rank allgathers the pushes and runs the boundary on its own copy);
// - ParallaxKvBoundaryMany waits, without holding a thread, until every rank pushed, then per
//   shard sums the pushes per id in rank order, averages the gradients over the ranks and runs
//   the shard's boundary (kv_shard.h) with the initial rows computed inside (id_hash.h), and
//   lets the reads waiting for it go (kv_pushes.h);
// - ParallaxKvCountersMany reads every shard's counters in one op.
// Shards and the pushes are found by container and shared name (kv_server.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
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
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

class KvPushOp : public OpKernel {
 public:
  explicit KvPushOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    OP_REQUIRES(c, rank_ >= 0 && rank_ < attrs_.ranks, Invalid("ParallaxKvPush: rank ", rank_, " of ", attrs_.ranks));
  }

  void Compute(OpKernelContext* ctx) override {
    Push push;
    push.message = ctx->input(0);
    const Tensor& payload = ctx->input(1);
    OP_REQUIRES_OK(ctx, ParseMessage(push.message, static_cast<int64_t>(attrs_.dims.size()), "ParallaxKvPush",
                                     &push.begin, &push.count));
    const int64_t floats = PayloadFloats(push.count.data(), attrs_.dims);
    OP_REQUIRES(ctx, payload.dims() == 1 && payload.NumElements() == floats,
                Invalid("ParallaxKvPush: the payload holds ", payload.NumElements(), " floats; the ids ask for ",
                        floats));
    push.payload = payload;
    tensorflow::core::RefCountPtr<KvPushes> pushes;
    OP_REQUIRES_OK(ctx, FindPushes(ctx, attrs_.container, attrs_.pushes, attrs_.ranks, &pushes));
    OP_REQUIRES_OK(ctx, pushes->Put(rank_, std::move(push)));
  }

 private:
  PushesAttrs attrs_;
  int64_t rank_;
};

// Every rank's push from their concatenations, rank after rank: each rank's message (its
// shards' id counts, then their ids) and its payload. Each is copied out whole (a slice of
// the concatenation would not be aligned for Eigen).
class KvPushAllOp : public OpKernel {
 public:
  explicit KvPushAllOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, attrs_.Read(c));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& messages = ctx->input(0);
    const Tensor& payloads = ctx->input(1);
    OP_REQUIRES(ctx, messages.dims() == 1 && payloads.dims() == 1,
                Invalid("ParallaxKvPushAll: messages and payloads must be vectors"));
    const int64_t parts = static_cast<int64_t>(attrs_.dims.size());
    const int64_t* ids = messages.flat<int64_t>().data();
    const float* rows = payloads.flat<float>().data();
    int64_t id_at = 0, row_at = 0;
    std::vector<Push> all(attrs_.ranks);
    for (int64_t r = 0; r < attrs_.ranks; ++r) {
      OP_REQUIRES(ctx, id_at + parts <= messages.NumElements(),
                  Invalid("ParallaxKvPushAll: the messages end before rank ", r, "'s"));
      int64_t length = parts;
      for (int64_t k = 0; k < parts; ++k) {
        OP_REQUIRES(ctx, ids[id_at + k] >= 0, Invalid("ParallaxKvPushAll: rank ", r, " counts ", ids[id_at + k]));
        length += ids[id_at + k];
      }
      const int64_t floats = PayloadFloats(ids + id_at, attrs_.dims);
      OP_REQUIRES(ctx, id_at + length <= messages.NumElements() && row_at + floats <= payloads.NumElements(),
                  Invalid("ParallaxKvPushAll: rank ", r, "'s push runs past the messages or payloads"));
      Push& push = all[r];
      push.message = Tensor(tensorflow::DT_INT64, TensorShape({length}));
      std::copy(ids + id_at, ids + id_at + length, push.message.flat<int64_t>().data());
      push.payload = Tensor(tensorflow::DT_FLOAT, TensorShape({floats}));
      std::copy(rows + row_at, rows + row_at + floats, push.payload.flat<float>().data());
      OP_REQUIRES_OK(ctx, ParseMessage(push.message, parts, "ParallaxKvPushAll", &push.begin, &push.count));
      id_at += length;
      row_at += floats;
    }
    OP_REQUIRES(ctx, id_at == messages.NumElements() && row_at == payloads.NumElements(),
                Invalid("ParallaxKvPushAll: ", messages.NumElements() - id_at, " ids and ",
                        payloads.NumElements() - row_at, " floats are left after ", attrs_.ranks, " ranks' pushes"));
    tensorflow::core::RefCountPtr<KvPushes> pushes;
    OP_REQUIRES_OK(ctx, FindPushes(ctx, attrs_.container, attrs_.pushes, attrs_.ranks, &pushes));
    for (int64_t r = 0; r < attrs_.ranks; ++r) OP_REQUIRES_OK(ctx, pushes->Put(r, std::move(all[r])));
  }

 private:
  PushesAttrs attrs_;
};

// Per id of one shard, its gradient rows and occurrences summed over the ranks' pushes in rank
// order; the gradients then averaged over the ranks.
struct Summed {
  std::vector<int64_t> ids, counts;
  std::vector<float> grads;
};

Summed SumPushes(const std::vector<Push>& pushes, const std::vector<int64_t>& offsets, int k, int64_t dim) {
  Summed out;
  std::vector<float> sums;
  absl::flat_hash_map<int64_t, int64_t> where;
  for (size_t r = 0; r < pushes.size(); ++r) {
    const int64_t* id = pushes[r].ids(k);
    const float* row = pushes[r].payload.flat<float>().data() + offsets[r];
    for (int64_t i = 0; i < pushes[r].count[k]; ++i, row += dim + 1) {
      auto [at, fresh] = where.try_emplace(id[i], static_cast<int64_t>(out.ids.size()));
      if (fresh) {
        out.ids.push_back(id[i]);
        sums.resize(sums.size() + dim + 1, 0.0f);
      }
      float* sum = sums.data() + at->second * (dim + 1);
      for (int64_t j = 0; j <= dim; ++j) sum[j] += row[j];
    }
  }
  const int64_t n = static_cast<int64_t>(out.ids.size());
  const float ranks = static_cast<float>(pushes.size());
  out.grads.resize(n * dim);
  out.counts.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < dim; ++j) out.grads[i * dim + j] = sums[i * (dim + 1) + j] / ranks;
    out.counts[i] = static_cast<int64_t>(std::nearbyint(sums[i * (dim + 1) + dim]));
  }
  return out;
}

class KvBoundaryManyOp : public AsyncOpKernel {
 public:
  explicit KvBoundaryManyOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    std::vector<std::string> kinds;
    std::vector<bool> nesterov;
    std::vector<float> powers, slot_initial;
    std::vector<int64_t> admit_after, evict_after, slot_counts;
    OP_REQUIRES_OK(c, attrs_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("shared_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("kinds", &kinds));
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov));
    OP_REQUIRES_OK(c, c->GetAttr("learning_rate_powers", &powers));
    OP_REQUIRES_OK(c, c->GetAttr("admit_after", &admit_after));
    OP_REQUIRES_OK(c, c->GetAttr("evict_after", &evict_after));
    OP_REQUIRES_OK(c, c->GetAttr("slot_counts", &slot_counts));
    OP_REQUIRES_OK(c, c->GetAttr("slot_initial", &slot_initial));
    const size_t n = names_.size();
    OP_REQUIRES_OK(c, ParseLaws(c, "ParallaxKvBoundaryMany", n, &laws_));
    for (size_t size : {attrs_.dims.size(), kinds.size(), nesterov.size(), powers.size(), admit_after.size(),
                        evict_after.size(), slot_counts.size()})
      OP_REQUIRES(c, size == n, Invalid("ParallaxKvBoundaryMany: ", n, " shards, but an attr lists ", size));
    size_t slot_at = 0;
    for (size_t k = 0; k < n; ++k) {
      Boundary b;
      OP_REQUIRES(c, ParseRuleKind(kinds[k], &b.rule.kind), Invalid("ParallaxKvBoundaryMany: no rule ", kinds[k]));
      b.rule.nesterov = nesterov[k];
      b.rule.learning_rate_power = powers[k];
      b.admit_after = admit_after[k];
      b.evict_after = evict_after[k];
      OP_REQUIRES(c, slot_at + slot_counts[k] <= slot_initial.size(),
                  Invalid("ParallaxKvBoundaryMany: slot_initial lists too few values"));
      b.slot_initial.assign(slot_initial.begin() + slot_at, slot_initial.begin() + slot_at + slot_counts[k]);
      slot_at += slot_counts[k];
      boundaries_.push_back(b);
      hyper_count_ += HyperCount(b.rule.kind);
    }
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor hyper = ctx->input(0);
    const int64_t shards = static_cast<int64_t>(names_.size());
    OP_REQUIRES_ASYNC(ctx, hyper.NumElements() == hyper_count_,
                      Invalid("ParallaxKvBoundaryMany: the rules take ", hyper_count_, " hyper-parameters, got ",
                              hyper.NumElements()), done);
    tensorflow::core::RefCountPtr<KvPushes> pushes;
    OP_REQUIRES_OK_ASYNC(ctx, FindPushes(ctx, attrs_.container, attrs_.pushes, attrs_.ranks, &pushes), done);
    tensorflow::CancellationManager* cm = ctx->cancellation_manager();
    const tensorflow::CancellationToken token = cm->get_cancellation_token();
    KvPushes* waited_on = pushes.get();
    const bool registered = cm->RegisterCallback(token, [ctx, done, waited_on]() {
      if (waited_on->Cancel()) {
        ctx->SetStatus(absl::CancelledError("ParallaxKvBoundaryMany: the step was cancelled before every rank pushed"));
        done();
      }
    });
    OP_REQUIRES_ASYNC(ctx, registered, absl::CancelledError("ParallaxKvBoundaryMany: the step was cancelled"), done);
    const absl::Status waiting = pushes->Wait([this, ctx, done, cm, token, hyper, waited_on](std::vector<Push> all) {
      cm->TryDeregisterCallback(token);
      ctx->SetStatus(Apply(ctx, all, hyper));
      waited_on->Finish();
      done();
    });
    if (!waiting.ok()) cm->TryDeregisterCallback(token);
    OP_REQUIRES_OK_ASYNC(ctx, waiting, done);
  }

 private:
  // Every shard's boundary on the ranks' pushes.
  absl::Status Apply(OpKernelContext* ctx, const std::vector<Push>& all, const Tensor& hyper) const {
    for (const Push& push : all) {
      if (push.count.size() != names_.size())
        return Invalid("ParallaxKvBoundaryMany: a push holds ", push.count.size(), " shards' ids for ", names_.size());
      const int64_t floats = PayloadFloats(push.count.data(), attrs_.dims);
      if (floats != push.payload.NumElements())
        return Invalid("ParallaxKvBoundaryMany: a push's payload holds ", push.payload.NumElements(),
                       " floats; its ids and the shards' dims ask for ", floats);
    }
    std::vector<int64_t> offsets(all.size(), 0);
    const float* h = hyper.flat<float>().data();
    std::vector<double> scratch;
    for (size_t k = 0; k < names_.size(); ++k) {
      const int64_t dim = attrs_.dims[k];
      Summed summed = SumPushes(all, offsets, static_cast<int>(k), dim);
      for (size_t r = 0; r < all.size(); ++r) offsets[r] += all[r].count[k] * (dim + 1);
      Boundary b = boundaries_[k];
      b.rule.hyper.assign(h, h + HyperCount(b.rule.kind));
      h += HyperCount(b.rule.kind);
      const RowLaw& law = laws_[k];
      scratch.resize(dim);
      tensorflow::core::RefCountPtr<KvShard> shard;
      TF_RETURN_IF_ERROR(FindShard(ctx, attrs_.container, names_[k], dim, &shard));
      absl::MutexLock l(shard->mu());
      TF_RETURN_IF_ERROR(b.Run(shard.get(), static_cast<int64_t>(summed.ids.size()), summed.ids.data(),
                               summed.grads.data(), summed.counts.data(), [&](int64_t i, float* row) {
                                 law.Row(summed.ids[i], dim, scratch.data(), row);
                               }));
    }
    return absl::OkStatus();
  }

  PushesAttrs attrs_;
  int64_t hyper_count_ = 0;
  std::vector<std::string> names_;
  std::vector<Boundary> boundaries_;
  std::vector<RowLaw> laws_;
};

// int64 [shards, 4]: each shard's live rows, boundaries so far, rows admitted, rows evicted.
class KvCountersManyOp : public OpKernel {
 public:
  explicit KvCountersManyOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("container", &container_));
    OP_REQUIRES_OK(c, c->GetAttr("shared_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t n = static_cast<int64_t>(names_.size());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, 4}), &out));
    for (int64_t k = 0; k < n; ++k) {
      tensorflow::core::RefCountPtr<KvShard> shard;
      OP_REQUIRES_OK(ctx, FindShard(ctx, container_, names_[k], dims_[k], &shard));
      absl::ReaderMutexLock l(shard->mu());
      shard->Counters(out->matrix<int64_t>().data() + 4 * k);
    }
  }

 private:
  std::string container_;
  std::vector<std::string> names_;
  std::vector<int64_t> dims_;
};

}  // namespace

REGISTER_OP("ParallaxKvPush")
    .Input("message: int64")
    .Input("payload: float")
    .Attr("dims: list(int) >= 1")
    .Attr("pushes: string")
    .Attr("rank: int >= 0")
    .Attr("ranks: int >= 1")
    .Attr("container: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Stores one rank's push of this step: a message of each shard's id count, then their ids (as "
         "ParallaxKvReadMany's); the payload of their gradient rows and occurrences, shard after shard.");

REGISTER_OP("ParallaxKvPushAll")
    .Input("messages: int64")
    .Input("payloads: float")
    .Attr("dims: list(int) >= 1")
    .Attr("pushes: string")
    .Attr("ranks: int >= 1")
    .Attr("container: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Stores every rank's push of this step from their concatenations, rank after rank: each rank's "
         "message (as ParallaxKvPush's) and its payload.");

REGISTER_OP("ParallaxKvBoundaryMany")
    .Input("hyper: float")
    .Attr("pushes: string")
    .Attr("ranks: int >= 1")
    .Attr("shared_names: list(string) >= 1")
    .Attr("dims: list(int)")
    .Attr("kinds: list(string)")
    .Attr("nesterov: list(bool)")
    .Attr("learning_rate_powers: list(float)")
    .Attr("admit_after: list(int)")
    .Attr("evict_after: list(int)")
    .Attr("slot_counts: list(int)")
    .Attr("slot_initial: list(float)")
    .Attr("law_kinds: list(string)")
    .Attr("salts: list(int)")
    .Attr("law_values: tensor")
    .Attr("container: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Once every rank pushed: each shard's pushes summed per id, averaged, and its step boundary.");

REGISTER_OP("ParallaxKvCountersMany")
    .Attr("shared_names: list(string) >= 1")
    .Attr("dims: list(int)")
    .Attr("container: string = ''")
    .Output("counters: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->UnknownDim(), 4));
      return absl::OkStatus();
    })
    .Doc("Each shard's live rows, boundaries so far, rows admitted, rows evicted.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvPush").Device(::tensorflow::DEVICE_CPU), KvPushOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvPushAll").Device(::tensorflow::DEVICE_CPU), KvPushAllOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvBoundaryMany").Device(::tensorflow::DEVICE_CPU), KvBoundaryManyOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvCountersMany").Device(::tensorflow::DEVICE_CPU), KvCountersManyOp);

}  // namespace parallax
