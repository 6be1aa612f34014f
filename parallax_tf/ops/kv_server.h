// Finding a dynamic-table shard (kv_shard.h) by container and shared name in an op's device,
// as ParallaxKvShard's handle finds it: the ops that serve every shard of a server need no
// handle op per shard and step.
#ifndef PARALLAX_TF_OPS_KV_SERVER_H_
#define PARALLAX_TF_OPS_KV_SERVER_H_

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace parallax

#endif  // PARALLAX_TF_OPS_KV_SERVER_H_
