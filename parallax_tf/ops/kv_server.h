// Finding a dynamic-table shard (kv_shard.h) by container and shared name in an op's device,
// as ParallaxKvShard's handle finds it: the ops that serve every shard of a server need no
// handle op per shard and step.
#ifndef PARALLAX_TF_OPS_KV_SERVER_H_
#define PARALLAX_TF_OPS_KV_SERVER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "parallax_tf/ops/id_hash.h"
#include "parallax_tf/ops/kv_shard.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"

namespace parallax {

// The shard named `name` in `container` (empty: the default one) on this op's device, made
// (holding rows of `dim`) if no op made it yet: where ParallaxKvShard's handle finds it.
inline absl::Status FindShard(tensorflow::OpKernelContext* ctx, const std::string& container,
                              const std::string& name, int64_t dim,
                              tensorflow::core::RefCountPtr<KvShard>* shard) {
  tensorflow::ResourceMgr* rm = ctx->resource_manager();
  KvShard* found = nullptr;
  const std::string& in = container.empty() ? rm->default_container() : container;
  TF_RETURN_IF_ERROR(rm->LookupOrCreate<KvShard>(in, name, &found, [&](KvShard** made) {
    *made = new KvShard(dim, name);
    return absl::OkStatus();
  }));
  shard->reset(found);
  if (found->dim() != dim)
    return Invalid("dynamic table shard ", name, " holds rows of ", found->dim(), "; an op asks for ", dim);
  return absl::OkStatus();
}

// One rank's message to a server: `parts` id counts, then each part's ids, part after part (the
// reads of ParallaxKvReadMany, the pushes of ParallaxKvPush). Sets each part's first id's offset
// in the message and its count.
inline absl::Status ParseMessage(const tensorflow::Tensor& message, int64_t parts, const char* op,
                                 std::vector<int64_t>* begin, std::vector<int64_t>* count) {
  TF_RETURN_IF_ERROR(CheckIds(message, op));
  if (message.NumElements() < parts)
    return Invalid(op, ": the message holds ", message.NumElements(), " values for ", parts, " parts' counts");
  const int64_t* counts = message.flat<int64_t>().data();
  begin->clear();
  count->clear();
  int64_t at = parts;
  for (int64_t k = 0; k < parts; ++k) {
    if (counts[k] < 0) return Invalid(op, ": part ", k, " counts ", counts[k], " ids");
    begin->push_back(at);
    count->push_back(counts[k]);
    at += counts[k];
  }
  if (at != message.NumElements())
    return Invalid(op, ": the counts add up to ", at - parts, " ids; the message holds ", message.NumElements() - parts);
  return absl::OkStatus();
}

// Each of `n` shards' initial row law from an op's attrs: `law_kinds`, `salts` and
// `law_values`, a double tensor [n, 2] (an attr: no constant node runs each step).
inline absl::Status ParseLaws(tensorflow::OpKernelConstruction* c, const char* op, size_t n,
                              std::vector<RowLaw>* laws) {
  std::vector<std::string> kinds;
  std::vector<int64_t> salts;
  tensorflow::Tensor values;
  TF_RETURN_IF_ERROR(c->GetAttr("law_kinds", &kinds));
  TF_RETURN_IF_ERROR(c->GetAttr("salts", &salts));
  TF_RETURN_IF_ERROR(c->GetAttr("law_values", &values));
  if (kinds.size() != n || salts.size() != n)
    return Invalid(op, ": ", n, " shards but ", kinds.size(), " laws and ", salts.size(), " salts");
  if (values.dtype() != tensorflow::DT_DOUBLE) return Invalid(op, ": law_values must hold doubles");
  TF_RETURN_IF_ERROR(CheckRows(values, static_cast<int64_t>(n), 2, op, "law values"));
  const double* value = values.flat<double>().data();
  laws->resize(n);
  for (size_t k = 0; k < n; ++k) {
    if (!RowLaw::Parse(kinds[k], &(*laws)[k].kind)) return Invalid(op, ": no row law ", kinds[k]);
    (*laws)[k].salt = static_cast<uint64_t>(salts[k]);
    (*laws)[k].a = value[2 * k];
    (*laws)[k].b = value[2 * k + 1];
  }
  return absl::OkStatus();
}

}  // namespace parallax

#endif  // PARALLAX_TF_OPS_KV_SERVER_H_
