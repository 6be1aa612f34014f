// A rank's side of the compiled dynamic tables (kv_server_ops.cc, kv_step_ops.cc), one op each
// for every table and lookup of the step instead of a partition, a stitch and a few slices per
// lookup and shard:
// - ParallaxKvRoute: the entries' ids (a lookup's, or a table's pushed ids) split by owning
//   shard (id_hash.h's Owner) into one message per server (kv_server.h's ParseMessage);
// - ParallaxKvSpreadRows: rows aligned with the entries' ids, in the messages' order, one flat
//   tensor per server (a push's payload);
// - ParallaxKvGatherRows: the servers' flat answers to the messages back as each entry's rows,
//   aligned with its ids.
// Entry e's shards are `shards[e]`; its shard k lives on server `servers[sum(shards[:e]) + k]`.
// A server's message holds its parts (entry, shard) entry after entry, shard after shard; an
// entry's ids keep their order within a part.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallax_tf/ops/id_hash.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace parallax {
namespace {

using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpOutputList;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

struct Part {
  int64_t entry, shard;
};

// Per entry and shard, the positions of the entry's ids that shard owns, ascending.
using Owned = std::vector<std::vector<std::vector<int64_t>>>;

// Where every entry's shards live, from the ops' attrs.
struct Routing {
  std::vector<int64_t> shards;                // per entry
  std::vector<std::vector<Part>> parts;       // per server, in message order
  std::vector<int64_t> widths;                // per entry: floats a row (the row ops)

  absl::Status Parse(OpKernelConstruction* c, const char* op, bool rows) {
    std::vector<int64_t> servers;
    int64_t hosts;
    TF_RETURN_IF_ERROR(c->GetAttr("shards", &shards));
    TF_RETURN_IF_ERROR(c->GetAttr("servers", &servers));
    TF_RETURN_IF_ERROR(c->GetAttr("hosts", &hosts));
    if (rows) TF_RETURN_IF_ERROR(c->GetAttr("widths", &widths));
    if (rows && widths.size() != shards.size())
      return Invalid(op, ": ", shards.size(), " entries but ", widths.size(), " widths");
    parts.assign(hosts, {});
    size_t at = 0;
    for (int64_t e = 0; e < static_cast<int64_t>(shards.size()); ++e) {
      if (shards[e] < 1) return Invalid(op, ": entry ", e, " has ", shards[e], " shards");
      for (int64_t k = 0; k < shards[e]; ++k, ++at) {
        if (at >= servers.size()) return Invalid(op, ": servers lists ", servers.size(), " shards, too few");
        if (servers[at] < 0 || servers[at] >= hosts)
          return Invalid(op, ": shard ", k, " of entry ", e, " on server ", servers[at], " of ", hosts);
        parts[servers[at]].push_back({e, k});
      }
    }
    if (at != servers.size()) return Invalid(op, ": servers lists ", servers.size(), " shards, not ", at);
    return absl::OkStatus();
  }

  absl::Status Split(const OpInputList& ids, const char* op, Owned* at) const {
    if (ids.size() != static_cast<int>(shards.size()))
      return Invalid(op, ": ", ids.size(), " id vectors for ", shards.size(), " entries");
    at->assign(shards.size(), {});
    for (size_t e = 0; e < shards.size(); ++e) {
      if (ids[e].dims() != 1) return Invalid(op, ": ids must be vectors, got ", ids[e].shape().DebugString());
      auto& by_shard = (*at)[e];
      by_shard.assign(shards[e], {});
      const auto flat = ids[e].flat<int64_t>();
      for (int64_t i = 0; i < flat.size(); ++i) by_shard[Owner(flat(i), shards[e])].push_back(i);
    }
    return absl::OkStatus();
  }

  // The floats of server h's rows (the row ops).
  int64_t Floats(size_t h, const Owned& at) const {
    int64_t size = 0;
    for (const Part& p : parts[h]) size += static_cast<int64_t>(at[p.entry][p.shard].size()) * widths[p.entry];
    return size;
  }
};

class KvRouteOp : public OpKernel {
 public:
  explicit KvRouteOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, routing_.Parse(c, "ParallaxKvRoute", false));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    Owned at;
    OP_REQUIRES_OK(ctx, routing_.Split(ids, "ParallaxKvRoute", &at));
    OpOutputList messages;
    OP_REQUIRES_OK(ctx, ctx->output_list("messages", &messages));
    for (size_t h = 0; h < routing_.parts.size(); ++h) {
      const auto& parts = routing_.parts[h];
      int64_t size = static_cast<int64_t>(parts.size());
      for (const Part& p : parts) size += static_cast<int64_t>(at[p.entry][p.shard].size());
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, messages.allocate(h, TensorShape({size}), &out));
      int64_t* m = out->flat<int64_t>().data();
      for (const Part& p : parts) *m++ = static_cast<int64_t>(at[p.entry][p.shard].size());
      for (const Part& p : parts) {
        const int64_t* id = ids[p.entry].flat<int64_t>().data();
        for (int64_t i : at[p.entry][p.shard]) *m++ = id[i];
      }
    }
  }

 private:
  Routing routing_;
};

class KvSpreadRowsOp : public OpKernel {
 public:
  explicit KvSpreadRowsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, routing_.Parse(c, "ParallaxKvSpreadRows", true));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, rows;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("rows", &rows));
    Owned at;
    OP_REQUIRES_OK(ctx, routing_.Split(ids, "ParallaxKvSpreadRows", &at));
    for (int e = 0; e < rows.size(); ++e) {
      const int64_t w = routing_.widths[e];
      OP_REQUIRES(ctx, rows[e].NumElements() == ids[e].NumElements() * w,
                  Invalid("ParallaxKvSpreadRows: entry ", e, " has ", ids[e].NumElements(), " ids and ",
                          rows[e].NumElements(), " floats of rows ", w, " wide"));
    }
    OpOutputList flats;
    OP_REQUIRES_OK(ctx, ctx->output_list("flats", &flats));
    for (size_t h = 0; h < routing_.parts.size(); ++h) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, flats.allocate(h, TensorShape({routing_.Floats(h, at)}), &out));
      float* f = out->flat<float>().data();
      for (const Part& p : routing_.parts[h]) {
        const int64_t w = routing_.widths[p.entry];
        const float* row = rows[p.entry].flat<float>().data();
        for (int64_t i : at[p.entry][p.shard]) f = std::copy(row + i * w, row + (i + 1) * w, f);
      }
    }
  }

 private:
  Routing routing_;
};

class KvGatherRowsOp : public OpKernel {
 public:
  explicit KvGatherRowsOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, routing_.Parse(c, "ParallaxKvGatherRows", true));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList ids, flats;
    OP_REQUIRES_OK(ctx, ctx->input_list("ids", &ids));
    OP_REQUIRES_OK(ctx, ctx->input_list("flats", &flats));
    OP_REQUIRES(ctx, flats.size() == static_cast<int>(routing_.parts.size()),
                Invalid("ParallaxKvGatherRows: ", flats.size(), " answers for ", routing_.parts.size(), " servers"));
    Owned at;
    OP_REQUIRES_OK(ctx, routing_.Split(ids, "ParallaxKvGatherRows", &at));
    OpOutputList rows;
    OP_REQUIRES_OK(ctx, ctx->output_list("rows", &rows));
    std::vector<float*> out(ids.size());
    for (int e = 0; e < ids.size(); ++e) {
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, rows.allocate(e, TensorShape({ids[e].NumElements(), routing_.widths[e]}), &t));
      out[e] = t->flat<float>().data();
    }
    for (size_t h = 0; h < routing_.parts.size(); ++h) {
      const int64_t size = routing_.Floats(h, at);
      OP_REQUIRES(ctx, flats[h].dims() == 1 && flats[h].NumElements() == size,
                  Invalid("ParallaxKvGatherRows: server ", h, " answered ", flats[h].NumElements(),
                          " floats; its ids ask for ", size));
      const float* f = flats[h].flat<float>().data();
      for (const Part& p : routing_.parts[h]) {
        const int64_t w = routing_.widths[p.entry];
        for (int64_t i : at[p.entry][p.shard]) {
          std::copy(f, f + w, out[p.entry] + i * w);
          f += w;
        }
      }
    }
  }

 private:
  Routing routing_;
};

absl::Status PerServerShape(shape_inference::InferenceContext* c) {
  for (int h = 0; h < c->num_outputs(); ++h) c->set_output(h, c->Vector(c->UnknownDim()));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("ParallaxKvRoute")
    .Input("ids: N * int64")
    .Output("messages: hosts * int64")
    .Attr("N: int >= 1")
    .Attr("hosts: int >= 1")
    .Attr("shards: list(int)")
    .Attr("servers: list(int)")
    .SetShapeFn(PerServerShape)
    .Doc("Each entry's ids split by owning shard into one message per server: the parts' counts, then their ids.");

REGISTER_OP("ParallaxKvSpreadRows")
    .Input("ids: N * int64")
    .Input("rows: N * float")
    .Output("flats: hosts * float")
    .Attr("N: int >= 1")
    .Attr("hosts: int >= 1")
    .Attr("shards: list(int)")
    .Attr("servers: list(int)")
    .Attr("widths: list(int)")
    .SetShapeFn(PerServerShape)
    .Doc("Rows aligned with each entry's ids, flattened per server in the order of ParallaxKvRoute's messages.");

REGISTER_OP("ParallaxKvGatherRows")
    .Input("ids: N * int64")
    .Input("flats: hosts * float")
    .Output("rows: N * float")
    .Attr("N: int >= 1")
    .Attr("hosts: int >= 1")
    .Attr("shards: list(int)")
    .Attr("servers: list(int)")
    .Attr("widths: list(int)")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<int64_t> widths;
      TF_RETURN_IF_ERROR(c->GetAttr("widths", &widths));
      if (static_cast<int>(widths.size()) != c->num_outputs())
        return Invalid("ParallaxKvGatherRows: ", c->num_outputs(), " entries but ", widths.size(), " widths");
      for (int e = 0; e < c->num_outputs(); ++e) {
        shape_inference::ShapeHandle ids;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(e), 1, &ids));
        c->set_output(e, c->Matrix(c->Dim(ids, 0), widths[e]));
      }
      return absl::OkStatus();
    })
    .Doc("The servers' flat answers to ParallaxKvRoute's messages as each entry's rows, aligned with its ids.");

REGISTER_KERNEL_BUILDER(Name("ParallaxKvRoute").Device(::tensorflow::DEVICE_CPU), KvRouteOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvSpreadRows").Device(::tensorflow::DEVICE_CPU), KvSpreadRowsOp);
REGISTER_KERNEL_BUILDER(Name("ParallaxKvGatherRows").Device(::tensorflow::DEVICE_CPU), KvGatherRowsOp);

}  // namespace parallax
