// A server's pushes of one step, by rank (ParallaxKvPush stores them, ParallaxKvBoundaryMany
// takes them all), and the gate of the ranks' reads there: a rank's read waits until the
// boundaries have applied every push that rank made, so it reads the table the last boundary
// left without a token from rank 0 (a send and a receive per rank and server each step).
#ifndef PARALLAX_TF_OPS_KV_PUSHES_H_
#define PARALLAX_TF_OPS_KV_PUSHES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace parallax {

// One rank's push: per shard, its ids (a message: kv_server.h's ParseMessage), and the payload
// of [ids, dim + 1] rows, shard after shard.
struct Push {
  tensorflow::Tensor message;
  std::vector<int64_t> begin, count;
  tensorflow::Tensor payload;
  bool given = false;

  const int64_t* ids(size_t k) const { return message.flat<int64_t>().data() + begin[k]; }
};

// The floats of a push's payload: per shard k, each of its counts[k] ids' gradient row (dims[k]
// floats) and its occurrences.
inline int64_t PayloadFloats(const int64_t* counts, const std::vector<int64_t>& dims) {
  int64_t floats = 0;
  for (size_t k = 0; k < dims.size(); ++k) floats += counts[k] * (dims[k] + 1);
  return floats;
}

// The attributes of every op on a server's pushes: where they live, how many ranks push, each
// shard's row width.
struct PushesAttrs {
  std::string container, pushes;
  int64_t ranks = 0;
  std::vector<int64_t> dims;

  absl::Status Read(tensorflow::OpKernelConstruction* c) {
    TF_RETURN_IF_ERROR(c->GetAttr("container", &container));
    TF_RETURN_IF_ERROR(c->GetAttr("pushes", &pushes));
    TF_RETURN_IF_ERROR(c->GetAttr("ranks", &ranks));
    return c->GetAttr("dims", &dims);
  }
};

class KvPushes : public tensorflow::ResourceBase {
 public:
  using Taker = std::function<void(std::vector<Push>)>;
  using Reader = std::function<void(bool from_boundary)>;

  explicit KvPushes(int64_t ranks) : pushes_(ranks), pushed_(ranks, 0) {}
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
      ++pushed_[rank];
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

  // A boundary applied the pushes it took: runs the reads that waited for it (outside the lock).
  void Finish() {
    std::vector<Reader> ready;
    {
      absl::MutexLock l(&mu_);
      ++finished_;
      for (auto it = readers_.begin(); it != readers_.end();) {
        if (pushed_[it->rank] <= finished_) {
          ready.push_back(std::move(it->read));
          it = readers_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Reader& read : ready) read(true);
  }

  // Runs `read` once every push `rank` made here is applied: now (returns 0), else from the
  // boundary's Finish (returns a ticket for CancelRead).
  int64_t WhenApplied(int64_t rank, Reader read) {
    {
      absl::MutexLock l(&mu_);
      if (pushed_[rank] > finished_) {
        readers_.push_back({++tickets_, rank, std::move(read)});
        return tickets_;
      }
    }
    read(false);
    return 0;
  }

  // Drops a waiting read (its step was cancelled); whether it still waited.
  bool CancelRead(int64_t ticket) {
    absl::MutexLock l(&mu_);
    for (auto it = readers_.begin(); it != readers_.end(); ++it) {
      if (it->ticket == ticket) {
        readers_.erase(it);
        return true;
      }
    }
    return false;
  }

 private:
  struct WaitingRead {
    int64_t ticket, rank;
    Reader read;
  };

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
  std::vector<int64_t> pushed_ TF_GUARDED_BY(mu_);      // pushes each rank made, ever
  int64_t finished_ TF_GUARDED_BY(mu_) = 0;             // boundaries applied, ever
  std::vector<WaitingRead> readers_ TF_GUARDED_BY(mu_);
  int64_t tickets_ TF_GUARDED_BY(mu_) = 0;
};

inline absl::Status FindPushes(tensorflow::OpKernelContext* ctx, const std::string& container,
                               const std::string& name, int64_t ranks,
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

}  // namespace parallax

#endif  // PARALLAX_TF_OPS_KV_PUSHES_H_
