// A server's step for every dynamic-table shard it holds, one op per rank (its push) and one
// for rank 0 (the boundary), instead of an accumulator, a take and a boundary per shard:
// - ParallaxKvPush stores one rank's push (per shard: its distinct ids; one payload of their
//   gradient rows and occurrences) in the server's KvPushes;
// - ParallaxKvBoundaryMany waits, without holding a thread, until every rank pushed, then per
//   shard sums the pushes per id in rank order, averages the gradients over the ranks and runs
//   the shard's boundary (kv_shard.h) with the initial rows computed inside (id_hash.h);
// - ParallaxKvCountersMany reads every shard's counters in one op.
// Shards and the pushes are found by container and shared name (kv_server.h).
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "parallax_tf/ops/id_hash.h"
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

// One rank's push: per shard, its ids (a message: kv_server.h's ParseMessage), and the payload
// of [ids, dim + 1] rows, shard after shard.
struct Push {
  Tensor message;
  std::vector<int64_t> begin, count;
  Tensor payload;
  bool given = false;

  const int64_t* ids(size_t k) const { return message.flat<int64_t>().data() + begin[k]; }
};

// This step's pushes to one server, by rank, until the boundary takes them all.
class KvPushes : public tensorflow::ResourceBase {
 public:
  using Taker = std::function<void(std::vector<Push>)>;

  explicit KvPushes(int64_t ranks) : pushes_(ranks) {}
  std::string DebugString() const override { return "ParallaxKvPushes"; }
  int64_t ranks() const { return static_cast<int64_t>(pushes_.size()); }

  // Stores `rank`'s push; the last one of the step runs a waiting taker (outside the lock).
  absl::Status Put(int64_t rank, Push push) {
    Taker take;
    std::vector<Push> all;
    {
      absl::MutexLock l(&mu_);
      if (pushes_[rank].given) return Invalid("ParallaxKvPush: rank ", rank, " pushed twice in one step");
      push.given = true;
      pushes_[rank] = std::move(push);
      if (++count_ == ranks() && take_) {
        take.swap(take_);
        all = TakeLocked();
      }
    }
    if (take) take(std::move(all));
    return absl::OkStatus();
  }

  // Runs `take` with every rank's push: now if all are in, else from the last Put.
  absl::Status Wait(Taker take) {
    std::vector<Push> all;
    {
      absl::MutexLock l(&mu_);
      if (take_) return Invalid("ParallaxKvBoundaryMany: two boundaries wait on one server's pushes");
      if (count_ < ranks()) {
        take_ = std::move(take);
        return absl::OkStatus();
      }
      all = TakeLocked();
    }
    take(std::move(all));
    return absl::OkStatus();
  }

  // Drops the waiting taker (its step was cancelled); whether one waited.
  bool Cancel() {
    absl::MutexLock l(&mu_);
    const bool waited = static_cast<bool>(take_);
    take_ = nullptr;
    return waited;
  }

 private:
  std::vector<Push> TakeLocked() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Push> all(pushes_.size());
    all.swap(pushes_);
    count_ = 0;
    return all;
  }

  absl::Mutex mu_;
  std::vector<Push> pushes_ TF_GUARDED_BY(mu_);
  int64_t count_ TF_GUARDED_BY(mu_) = 0;
  Taker take_ TF_GUARDED_BY(mu_);
};

absl::Status FindPushes(OpKernelContext* ctx, const std::string& container, const std::string& name, int64_t ranks,
                        tensorflow::core::RefCountPtr<KvPushes>* pushes) {
  tensorflow::ResourceMgr* rm = ctx->resource_manager();
  KvPushes* found = nullptr;
  TF_RETURN_IF_ERROR(rm->LookupOrCreate<KvPushes>(container.empty() ? rm->default_container() : container, name,
                                                  &found, [&](KvPushes** made) {
                                                    *made = new KvPushes(ranks);
                                                    return absl::OkStatus();
                                                  }));
  pushes->reset(found);
  if (found->ranks() != ranks)
    return Invalid("the pushes ", name, " gather ", found->ranks(), " ranks; an op asks for ", ranks);
  return absl::OkStatus();
}

class KvPushOp : public OpKernel {
 public:
  explicit KvPushOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("container", &container_));
    OP_REQUIRES_OK(c, c->GetAttr("pushes", &pushes_name_));
    OP_REQUIRES_OK(c, c->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(c, c->GetAttr("ranks", &ranks_));
    OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_));
    OP_REQUIRES(c, rank_ >= 0 && rank_ < ranks_, Invalid("ParallaxKvPush: rank ", rank_, " of ", ranks_));
  }

  void Compute(OpKernelContext* ctx) override {
    Push push;
    push.message = ctx->input(0);
    const Tensor& payload = ctx->input(1);
    OP_REQUIRES_OK(ctx, ParseMessage(push.message, static_cast<int64_t>(dims_.size()), "ParallaxKvPush", &push.begin,
                                     &push.count));
    int64_t floats = 0;
    for (size_t k = 0; k < dims_.size(); ++k) floats += push.count[k] * (dims_[k] + 1);
    OP_REQUIRES(ctx, payload.dims() == 1 && payload.NumElements() == floats,
                Invalid("ParallaxKvPush: the payload holds ", payload.NumElements(), " floats; the ids ask for ",
                        floats));
    push.payload = payload;
    tensorflow::core::RefCountPtr<KvPushes> pushes;
    OP_REQUIRES_OK(ctx, FindPushes(ctx, container_, pushes_name_, ranks_, &pushes));
    OP_REQUIRES_OK(ctx, pushes->Put(rank_, std::move(push)));
  }

 private:
  std::string container_, pushes_name_;
  int64_t rank_, ranks_;
  std::vector<int64_t> dims_;
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
    std::vector<std::string> kinds, law_kinds;
    std::vector<bool> nesterov;
    std::vector<float> powers, slot_initial;
    std::vector<int64_t> admit_after, evict_after, slot_counts, salts;
    OP_REQUIRES_OK(c, c->GetAttr("container", &container_));
    OP_REQUIRES_OK(c, c->GetAttr("pushes", &pushes_name_));
    OP_REQUIRES_OK(c, c->GetAttr("ranks", &ranks_));
    OP_REQUIRES_OK(c, c->GetAttr("shared_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("dims", &dims_));
    OP_REQUIRES_OK(c, c->GetAttr("kinds", &kinds));
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov));
    OP_REQUIRES_OK(c, c->GetAttr("learning_rate_powers", &powers));
    OP_REQUIRES_OK(c, c->GetAttr("admit_after", &admit_after));
    OP_REQUIRES_OK(c, c->GetAttr("evict_after", &evict_after));
    OP_REQUIRES_OK(c, c->GetAttr("slot_counts", &slot_counts));
    OP_REQUIRES_OK(c, c->GetAttr("slot_initial", &slot_initial));
    OP_REQUIRES_OK(c, c->GetAttr("law_kinds", &law_kinds));
    OP_REQUIRES_OK(c, c->GetAttr("salts", &salts));
    const size_t n = names_.size();
    for (size_t size : {dims_.size(), kinds.size(), nesterov.size(), powers.size(), admit_after.size(),
                        evict_after.size(), slot_counts.size(), law_kinds.size(), salts.size()})
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
      RowLaw law;
      OP_REQUIRES(c, RowLaw::Parse(law_kinds[k], &law.kind), Invalid("ParallaxKvBoundaryMany: no law ", law_kinds[k]));
      law.salt = static_cast<uint64_t>(salts[k]);
      laws_.push_back(law);
      hyper_count_ += HyperCount(b.rule.kind);
    }
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor hyper = ctx->input(0), law_values = ctx->input(1);
    const int64_t shards = static_cast<int64_t>(names_.size());
    OP_REQUIRES_ASYNC(ctx, hyper.NumElements() == hyper_count_,
                      Invalid("ParallaxKvBoundaryMany: the rules take ", hyper_count_, " hyper-parameters, got ",
                              hyper.NumElements()), done);
    OP_REQUIRES_OK_ASYNC(ctx, CheckRows(law_values, shards, 2, "ParallaxKvBoundaryMany", "law values"), done);
    tensorflow::core::RefCountPtr<KvPushes> pushes;
    OP_REQUIRES_OK_ASYNC(ctx, FindPushes(ctx, container_, pushes_name_, ranks_, &pushes), done);
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
    const absl::Status waiting = pushes->Wait([this, ctx, done, cm, token, hyper, law_values](std::vector<Push> all) {
      cm->TryDeregisterCallback(token);
      ctx->SetStatus(Apply(ctx, all, hyper, law_values));
      done();
    });
    if (!waiting.ok()) cm->TryDeregisterCallback(token);
    OP_REQUIRES_OK_ASYNC(ctx, waiting, done);
  }

 private:
  // Every shard's boundary on the ranks' pushes.
  absl::Status Apply(OpKernelContext* ctx, const std::vector<Push>& all, const Tensor& hyper,
                     const Tensor& law_values) const {
    for (const Push& push : all) {
      if (push.count.size() != names_.size())
        return Invalid("ParallaxKvBoundaryMany: a push holds ", push.count.size(), " shards' ids for ", names_.size());
      int64_t floats = 0;
      for (size_t k = 0; k < names_.size(); ++k) floats += push.count[k] * (dims_[k] + 1);
      if (floats != push.payload.NumElements())
        return Invalid("ParallaxKvBoundaryMany: a push's payload holds ", push.payload.NumElements(),
                       " floats; its ids and the shards' dims ask for ", floats);
    }
    std::vector<int64_t> offsets(all.size(), 0);
    const float* h = hyper.flat<float>().data();
    const double* law_value = law_values.flat<double>().data();
    std::vector<double> scratch;
    for (size_t k = 0; k < names_.size(); ++k) {
      const int64_t dim = dims_[k];
      Summed summed = SumPushes(all, offsets, static_cast<int>(k), dim);
      for (size_t r = 0; r < all.size(); ++r) offsets[r] += all[r].count[k] * (dim + 1);
      Boundary b = boundaries_[k];
      b.rule.hyper.assign(h, h + HyperCount(b.rule.kind));
      h += HyperCount(b.rule.kind);
      RowLaw law = laws_[k];
      law.a = law_value[2 * k];
      law.b = law_value[2 * k + 1];
      scratch.resize(dim);
      tensorflow::core::RefCountPtr<KvShard> shard;
      TF_RETURN_IF_ERROR(FindShard(ctx, container_, names_[k], dim, &shard));
      absl::MutexLock l(shard->mu());
      TF_RETURN_IF_ERROR(b.Run(shard.get(), static_cast<int64_t>(summed.ids.size()), summed.ids.data(),
                               summed.grads.data(), summed.counts.data(), [&](int64_t i, float* row) {
                                 law.Row(summed.ids[i], dim, scratch.data(), row);
                               }));
    }
    return absl::OkStatus();
  }

  std::string container_, pushes_name_;
  int64_t ranks_, hyper_count_ = 0;
  std::vector<std::string> names_;
  std::vector<int64_t> dims_;
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

REGISTER_OP("ParallaxKvBoundaryMany")
    .Input("hyper: float")
    .Input("law_values: double")
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
REGISTER_KERNEL_BUILDER(Name("ParallaxKvBoundaryMany").Device(::tensorflow::DEVICE_CPU), KvBoundaryManyOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvCountersMany").Device(::tensorflow::DEVICE_CPU), KvCountersManyOp);

}  // namespace parallax
