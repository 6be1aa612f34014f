// A dynamic table shard's compiled ops (kv_shard.h): a read is one op per shard and step, the
// step boundary one op (the step's summed gradients in; admission, last-seen stamps, the
// optimizer's rule on row and slots, eviction in one pass), export and import whole arrays for
// checkpoints, tracked/remove for the capacity that spans a table's shards.
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
    OP_REQUIRES_OK(c, c->GetAttr("slots", &slots_));
  }

 private:
  absl::Status CreateResource(KvShard** resource) override TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    *resource = new KvShard(dim_, slots_, cinfo_.name());
    return absl::OkStatus();
  }
  absl::Status VerifyResource(KvShard* shard) override {
    if (shard->dim() != dim_ || shard->slots() != slots_)
      return Invalid("dynamic table shard ", shard->name(), " holds rows of ", shard->dim(), " with ", shard->slots(),
                     " slot(s); this op asks for ", dim_, " with ", slots_);
    return absl::OkStatus();
  }
  int64_t dim_, slots_;
};

absl::Status Ids(const Tensor& ids, const char* op) {
  if (ids.dims() != 1) return Invalid(op, ": ids must be a vector, got ", ids.shape().DebugString());
  return absl::OkStatus();
}

absl::Status Rows(const Tensor& rows, int64_t n, int64_t dim, const char* op, const char* what) {
  if (rows.dims() != 2 || rows.dim_size(0) != n || rows.dim_size(1) != dim)
    return Invalid(op, ": ", what, " must be [", n, ", ", dim, "], got ", rows.shape().DebugString());
  return absl::OkStatus();
}

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
    OP_REQUIRES_OK(ctx, Ids(ids, "ParallaxKvRead"));
    const int64_t n = ids.NumElements(), dim = shard->dim();
    OP_REQUIRES_OK(ctx, Rows(initial, n, dim, "ParallaxKvRead", "initial rows"));
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
    const std::vector<std::pair<std::string, RuleKind>> kinds = {
        {"sgd", RuleKind::kSgd}, {"momentum", RuleKind::kMomentum}, {"adagrad", RuleKind::kAdagrad},
        {"adam", RuleKind::kAdam}, {"ftrl", RuleKind::kFtrl}};
    auto found = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
    OP_REQUIRES(c, found != kinds.end(), Invalid("ParallaxKvBoundary: no row rule ", kind));
    rule_.kind = found->second;
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
    const int64_t n = ids.NumElements(), dim = shard->dim(), slots = shard->slots();
    OP_REQUIRES_OK(ctx, Ids(ids, "ParallaxKvBoundary"));
    OP_REQUIRES_OK(ctx, Rows(grads, n, dim, "ParallaxKvBoundary", "gradients"));
    OP_REQUIRES_OK(ctx, Rows(initial, n, dim, "ParallaxKvBoundary", "initial rows"));
    OP_REQUIRES(ctx, counts.NumElements() == n, Invalid("ParallaxKvBoundary: ", n, " ids, ", counts.NumElements(),
                                                        " counts"));
    OP_REQUIRES(ctx, hyper.NumElements() == HyperCount(rule_.kind) && static_cast<int64_t>(slot_initial_.size()) == slots,
                Invalid("ParallaxKvBoundary: the rule takes ", HyperCount(rule_.kind), " hyper-parameters and the shard ",
                        slots, " slots; got ", hyper.NumElements(), " and ", slot_initial_.size()));
    Rule rule = rule_;
    rule.hyper.assign(hyper.flat<float>().data(), hyper.flat<float>().data() + hyper.NumElements());
    const int64_t* id = ids.flat<int64_t>().data();
    const int64_t* count = counts.flat<int64_t>().data();
    const float* grad = grads.flat<float>().data();
    const float* fresh = initial.flat<float>().data();

    absl::MutexLock l(shard->mu());
    auto& entries = shard->entries();
    Clock& clock = shard->clock();
    const int64_t step = clock.step;
    int64_t admitted = 0;
    std::vector<float*> slot(slots);
    for (int64_t i = 0; i < n; ++i) {
      Entry& e = entries[id[i]];
      const bool was_live = e.live;
      e.count += count[i];
      const bool admit = !was_live && (admit_after_ == 1 || e.count >= admit_after_);
      if (admit) {  // the initial row, each slot at its start
        e.data.resize((1 + slots) * dim);
        std::copy(fresh + i * dim, fresh + (i + 1) * dim, e.data.begin());
        for (int64_t k = 0; k < slots; ++k)
          std::fill(e.data.begin() + (1 + k) * dim, e.data.begin() + (2 + k) * dim, slot_initial_[k]);
        ++admitted;
      }
      // live ids train; with admission on first use a new id trains from its initial row
      if (was_live || (admit && admit_after_ == 1)) {
        for (int64_t k = 0; k < slots; ++k) slot[k] = e.data.data() + (1 + k) * dim;
        ApplyRule(rule, dim, step, grad + i * dim, e.data.data(), slot);
      }
      e.live = was_live || admit;
      e.last_seen = step;
    }
    int64_t evicted = 0;
    if (evict_after_ >= 0) {
      for (auto it = entries.begin(); it != entries.end();) {
        if (it->second.last_seen <= step - evict_after_) {
          evicted += it->second.live;
          entries.erase(it++);
        } else {
          ++it;
        }
      }
    }
    clock = Clock{step + 1, clock.admitted + admitted, clock.evicted + evicted};
  }

 private:
  Rule rule_;
  int64_t admit_after_, evict_after_;
  std::vector<float> slot_initial_;
};

// Whole contents (store.Shard.export): live rows with their slots, and every tracked id's
// occurrences, last step seen and liveness, ids ascending; the clock.
class KvExportOp : public OpKernel {
 public:
  explicit KvExportOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const int64_t dim = shard->dim(), slots = shard->slots();
    absl::ReaderMutexLock l(shard->mu());
    auto& entries = shard->entries();
    std::vector<int64_t> seen, live;
    for (const auto& kv : entries) {
      seen.push_back(kv.first);
      if (kv.second.live) live.push_back(kv.first);
    }
    std::sort(seen.begin(), seen.end());
    std::sort(live.begin(), live.end());
    const int64_t rows = static_cast<int64_t>(live.size()), tracked = static_cast<int64_t>(seen.size());
    Tensor *ids, *values, *slot_values, *seen_ids, *counts, *last_seen, *is_live, *clock;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows}), &ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({rows, dim}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({slots, rows, dim}), &slot_values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({tracked}), &seen_ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({tracked}), &counts));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({tracked}), &last_seen));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({tracked}), &is_live));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({3}), &clock));
    for (int64_t i = 0; i < rows; ++i) {
      const Entry& e = entries.at(live[i]);
      ids->flat<int64_t>()(i) = live[i];
      std::copy(e.data.begin(), e.data.begin() + dim, values->flat<float>().data() + i * dim);
      for (int64_t k = 0; k < slots; ++k)
        std::copy(e.data.begin() + (1 + k) * dim, e.data.begin() + (2 + k) * dim,
                  slot_values->flat<float>().data() + (k * rows + i) * dim);
    }
    for (int64_t i = 0; i < tracked; ++i) {
      const Entry& e = entries.at(seen[i]);
      seen_ids->flat<int64_t>()(i) = seen[i];
      counts->flat<int64_t>()(i) = e.count;
      last_seen->flat<int64_t>()(i) = e.last_seen;
      is_live->flat<int64_t>()(i) = e.live;
    }
    const Clock& c = shard->clock();
    clock->flat<int64_t>()(0) = c.step;
    clock->flat<int64_t>()(1) = c.admitted;
    clock->flat<int64_t>()(2) = c.evicted;
  }
};

// Replaces the shard's contents with export's arrays (store.Shard.load).
class KvImportOp : public OpKernel {
 public:
  explicit KvImportOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const int64_t dim = shard->dim(), slots = shard->slots();
    const Tensor &ids = ctx->input(1), &values = ctx->input(2), &slot_values = ctx->input(3);
    const Tensor &seen_ids = ctx->input(4), &counts = ctx->input(5), &last_seen = ctx->input(6);
    const Tensor &is_live = ctx->input(7), &clock = ctx->input(8);
    const int64_t rows = ids.NumElements(), tracked = seen_ids.NumElements();
    OP_REQUIRES_OK(ctx, Rows(values, rows, dim, "ParallaxKvImport", "values"));
    OP_REQUIRES(ctx, slot_values.NumElements() == slots * rows * dim && counts.NumElements() == tracked &&
                     last_seen.NumElements() == tracked && is_live.NumElements() == tracked && clock.NumElements() == 3,
                Invalid("ParallaxKvImport: the arrays disagree with each other or with the shard's ", slots, " slots"));
    absl::MutexLock l(shard->mu());
    auto& entries = shard->entries();
    entries.clear();
    for (int64_t i = 0; i < tracked; ++i) {
      Entry& e = entries[seen_ids.flat<int64_t>()(i)];
      e.count = counts.flat<int64_t>()(i);
      e.last_seen = last_seen.flat<int64_t>()(i);
      e.live = is_live.flat<int64_t>()(i) != 0;
    }
    for (int64_t i = 0; i < rows; ++i) {
      Entry& e = entries[ids.flat<int64_t>()(i)];
      OP_REQUIRES(ctx, e.live, Invalid("ParallaxKvImport: id ", ids.flat<int64_t>()(i), " has a row but is not live"));
      e.data.resize((1 + slots) * dim);
      const float* row = values.flat<float>().data() + i * dim;
      std::copy(row, row + dim, e.data.begin());
      for (int64_t k = 0; k < slots; ++k) {
        const float* s = slot_values.flat<float>().data() + (k * rows + i) * dim;
        std::copy(s, s + dim, e.data.begin() + (1 + k) * dim);
      }
    }
    for (const auto& kv : entries)
      OP_REQUIRES(ctx, !kv.second.live || !kv.second.data.empty(),
                  Invalid("ParallaxKvImport: id ", kv.first, " is live but has no row"));
    shard->clock() = Clock{clock.flat<int64_t>()(0), clock.flat<int64_t>()(1), clock.flat<int64_t>()(2)};
  }
};

// Removes `keys` (ids the table's capacity drops); with count_evicted, adds the live ones
// among them to the clock's evicted rows. Returns how many live rows left.
class KvRemoveOp : public OpKernel {
 public:
  explicit KvRemoveOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("count_evicted", &count_evicted_));
  }

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const Tensor& keys = ctx->input(1);
    OP_REQUIRES_OK(ctx, Ids(keys, "ParallaxKvRemove"));
    absl::MutexLock l(shard->mu());
    auto& entries = shard->entries();
    int64_t live = 0;
    for (int64_t i = 0; i < keys.NumElements(); ++i) {
      auto it = entries.find(keys.flat<int64_t>()(i));
      if (it == entries.end()) continue;
      live += it->second.live;
      entries.erase(it);
    }
    if (count_evicted_) shard->clock().evicted += live;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = live;
  }

 private:
  bool count_evicted_;
};

}  // namespace

REGISTER_OP("ParallaxKvShard")
    .Output("handle: resource")
    .Attr("dim: int >= 1")
    .Attr("slots: int >= 0")
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

REGISTER_OP("ParallaxKvExport")
    .Input("handle: resource")
    .Output("ids: int64")
    .Output("values: float")
    .Output("slot_values: float")
    .Output("seen_ids: int64")
    .Output("counts: int64")
    .Output("last_seen: int64")
    .Output("live: int64")
    .Output("clock: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i : {0, 3, 4, 5, 6}) c->set_output(i, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), c->UnknownDim()));
      c->set_output(2, c->UnknownShapeOfRank(3));
      c->set_output(7, c->Vector(3));
      return absl::OkStatus();
    })
    .Doc("Live rows (ids ascending) with each slot's rows, every tracked id's counters, the clock.");

REGISTER_OP("ParallaxKvImport")
    .Input("handle: resource")
    .Input("ids: int64")
    .Input("values: float")
    .Input("slot_values: float")
    .Input("seen_ids: int64")
    .Input("counts: int64")
    .Input("last_seen: int64")
    .Input("live: int64")
    .Input("clock: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Replaces the shard's contents with ParallaxKvExport's arrays.");

REGISTER_OP("ParallaxKvRemove")
    .Input("handle: resource")
    .Input("keys: int64")
    .Output("live_removed: int64")
    .Attr("count_evicted: bool = true")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("Removes ids; counts the live ones among them as evicted.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvExport").Device(DEVICE_CPU), KvExportOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvImport").Device(DEVICE_CPU), KvImportOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvRemove").Device(DEVICE_CPU), KvRemoveOp);

}  // namespace parallax
