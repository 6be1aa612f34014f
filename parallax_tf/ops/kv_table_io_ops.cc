// A dynamic table shard's whole contents and bookkeeping (kv_shard.h): export and import of
// whole arrays for checkpoints and results, the counters a step reports, and the tracked ids
// and their removal for the capacity that spans a table's shards.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "parallax_tf/ops/id_hash.h"
#include "parallax_tf/ops/kv_shard.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
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

// Whole contents (store.Shard.export): live rows with their slots, and every tracked id's
// occurrences, last step seen and liveness, ids ascending; the clock.
class KvExportOp : public OpKernel {
 public:
  explicit KvExportOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("slots", &slots_));
  }

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const int64_t dim = shard->dim(), slots = slots_;
    absl::ReaderMutexLock l(shard->mu());
    // a shard no boundary or import has written yet holds no rows: any slot count exports it
    OP_REQUIRES(ctx, shard->slots() < 0 || shard->slots() == slots,
                Invalid("ParallaxKvExport: shard ", shard->name(), " holds ", shard->slots(), " slot(s), not ", slots));
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

 private:
  int64_t slots_;
};

// Replaces the shard's contents with export's arrays (store.Shard.load).
class KvImportOp : public OpKernel {
 public:
  explicit KvImportOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("shard", &shard_));
    OP_REQUIRES_OK(c, c->GetAttr("shards", &shards_));
    OP_REQUIRES(c, shard_ >= 0 && shard_ < shards_, Invalid("ParallaxKvImport: shard ", shard_, " of ", shards_));
  }

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    const Tensor &ids = ctx->input(1), &values = ctx->input(2), &slot_values = ctx->input(3);
    OP_REQUIRES(ctx, slot_values.dims() == 3, Invalid("ParallaxKvImport: slot values must be [slots, rows, dim], got ",
                                                      slot_values.shape().DebugString()));
    const int64_t dim = shard->dim(), slots = slot_values.dim_size(0);
    const Tensor &seen_ids = ctx->input(4), &counts = ctx->input(5), &last_seen = ctx->input(6);
    const Tensor &is_live = ctx->input(7), &clock = ctx->input(8);
    const int64_t rows = ids.NumElements(), tracked = seen_ids.NumElements();
    OP_REQUIRES_OK(ctx, CheckRows(values, rows, dim, "ParallaxKvImport", "values"));
    OP_REQUIRES(ctx, slot_values.NumElements() == slots * rows * dim && counts.NumElements() == tracked &&
                     last_seen.NumElements() == tracked && is_live.NumElements() == tracked && clock.NumElements() == 3,
                Invalid("ParallaxKvImport: the arrays disagree with each other or with the shard's ", slots, " slots"));
    absl::flat_hash_map<int64_t, Entry> entries;    // the shard's only once every check passed
    for (int64_t i = 0; i < tracked; ++i) {
      if (!Mine(seen_ids.flat<int64_t>()(i))) continue;
      Entry& e = entries[seen_ids.flat<int64_t>()(i)];
      e.count = counts.flat<int64_t>()(i);
      e.last_seen = last_seen.flat<int64_t>()(i);
      e.live = is_live.flat<int64_t>()(i) != 0;
    }
    for (int64_t i = 0; i < rows; ++i) {
      if (!Mine(ids.flat<int64_t>()(i))) continue;
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
    absl::MutexLock l(shard->mu());
    OP_REQUIRES_OK(ctx, shard->FixSlots(slots));
    shard->Replace(std::move(entries));
    // every shard counts the table's boundaries; its admitted and evicted totals stay on shard 0
    const bool first = shard_ == 0;
    shard->clock() = Clock{clock.flat<int64_t>()(0), first ? clock.flat<int64_t>()(1) : 0,
                           first ? clock.flat<int64_t>()(2) : 0};
  }

 private:
  bool Mine(int64_t id) const { return shards_ == 1 || Owner(id, shards_) == shard_; }

  int64_t shard_, shards_;
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
    OP_REQUIRES_OK(ctx, CheckIds(keys, "ParallaxKvRemove"));
    absl::MutexLock l(shard->mu());
    const int64_t live = shard->Erase(keys.flat<int64_t>().data(), keys.NumElements());
    if (count_evicted_) shard->clock().evicted += live;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = live;
  }

 private:
  bool count_evicted_;
};

// int64 [4]: live rows, boundaries so far, rows admitted, rows evicted (store.Shard.counters).
class KvCountersOp : public OpKernel {
 public:
  explicit KvCountersOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({4}), &out));
    absl::ReaderMutexLock l(shard->mu());
    shard->Counters(out->flat<int64_t>().data());
  }
};

// Every tracked id (ascending), the last boundary that saw it and whether it has a row
// (store.Shard.tracked), without the rows themselves.
class KvTrackedOp : public OpKernel {
 public:
  explicit KvTrackedOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    ShardPtr shard;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &shard));
    absl::ReaderMutexLock l(shard->mu());
    const auto& entries = shard->entries();
    std::vector<int64_t> seen;
    seen.reserve(entries.size());
    for (const auto& kv : entries) seen.push_back(kv.first);
    std::sort(seen.begin(), seen.end());
    const int64_t n = static_cast<int64_t>(seen.size());
    Tensor *ids, *last_seen, *live;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &ids));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &last_seen));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n}), &live));
    for (int64_t i = 0; i < n; ++i) {
      const Entry& e = entries.at(seen[i]);
      ids->flat<int64_t>()(i) = seen[i];
      last_seen->flat<int64_t>()(i) = e.last_seen;
      live->flat<bool>()(i) = e.live;
    }
  }
};

}  // namespace

REGISTER_OP("ParallaxKvExport")
    .Input("handle: resource")
    .Attr("slots: int >= 0")
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
    .Attr("shard: int >= 0 = 0")
    .Attr("shards: int >= 1 = 1")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Replaces the shard's contents with ParallaxKvExport's arrays: the table's whole arrays, of which it "
         "keeps the ids shard `shard` of `shards` owns (ParallaxIdOwner's).");

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

REGISTER_OP("ParallaxKvCounters")
    .Input("handle: resource")
    .Output("counters: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(4));
      return absl::OkStatus();
    })
    .Doc("Live rows, boundaries so far, rows admitted, rows evicted.");

REGISTER_OP("ParallaxKvTracked")
    .Input("handle: resource")
    .Output("ids: int64")
    .Output("last_seen: int64")
    .Output("live: bool")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("Every tracked id, ascending, with the last boundary that saw it and whether it has a row.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvCounters").Device(DEVICE_CPU), KvCountersOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvTracked").Device(DEVICE_CPU), KvTrackedOp);

}  // namespace parallax
