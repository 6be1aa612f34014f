// One shard of a dynamic table in one compiled hash map: id -> entry, the entry holding the row,
// the optimizer's slots beside it and the id's bookkeeping (occurrences, last step seen, live),
// so that a read is one probe per id and a boundary one pass over the step's ids. The semantics
// are parallax_tf/dynamic/store.py's, which stays the reference (and what a served model runs).
#ifndef PARALLAX_TF_OPS_KV_SHARD_H_
#define PARALLAX_TF_OPS_KV_SHARD_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "parallax_tf/ops/op_errors.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"

namespace parallax {

// The optimizer's row rule, as parallax_tf/dynamic/rules.py writes it (the same float32 steps).
enum class RuleKind { kSgd, kMomentum, kAdagrad, kAdam, kFtrl };

inline bool ParseRuleKind(const std::string& name, RuleKind* kind) {
  static const std::pair<const char*, RuleKind> kKinds[] = {
      {"sgd", RuleKind::kSgd}, {"momentum", RuleKind::kMomentum}, {"adagrad", RuleKind::kAdagrad},
      {"adam", RuleKind::kAdam}, {"ftrl", RuleKind::kFtrl}};
  for (const auto& k : kKinds) {
    if (name == k.first) {
      *kind = k.second;
      return true;
    }
  }
  return false;
}

struct Rule {
  RuleKind kind;
  std::vector<float> hyper;   // per kind, in the order RuleHyperNames gives
  bool nesterov = false;
  float learning_rate_power = -0.5f;
};

struct Entry {
  int64_t count = 0;          // occurrences so far
  int64_t last_seen = -1;     // the boundary that last saw the id
  bool live = false;          // has a row (admitted)
  std::vector<float> data;    // row, then each slot: (1 + slots) * dim
};

struct Clock {
  int64_t step = 0, admitted = 0, evicted = 0;
};

class KvShard : public tensorflow::ResourceBase {
 public:
  KvShard(int64_t dim, std::string name) : dim_(dim), name_(std::move(name)) {}

  std::string DebugString() const override { return absl::StrCat("ParallaxKvShard ", name_); }
  int64_t dim() const { return dim_; }
  const std::string& name() const { return name_; }

  // The optimizer's slots per row: unknown (-1) until the first boundary or import fixes them.
  int64_t slots() const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return slots_; }
  absl::Status FixSlots(int64_t slots) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (slots_ < 0) slots_ = slots;
    if (slots_ != slots)
      return absl::InvalidArgumentError(absl::StrCat("dynamic table shard ", name_, " holds ", slots_,
                                                     " slot(s) per row; an op asks for ", slots));
    return absl::OkStatus();
  }

  absl::Mutex* mu() { return &mu_; }
  // Who sets an entry's `live` calls AddLive, and entries leave through Erase, SeenAndEvict or
  // Replace: the shard counts its live rows and buckets its ids by last boundary seen.
  absl::flat_hash_map<int64_t, Entry>& entries() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entries_; }
  Clock& clock() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return clock_; }
  void AddLive(int64_t rows) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) { live_rows_ += rows; }
  // Erases ids (absent ones are skipped); returns how many of them had rows.
  int64_t Erase(const int64_t* ids, int64_t n) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t live = 0;
    for (int64_t i = 0; i < n; ++i) {
      auto it = entries_.find(ids[i]);
      if (it != entries_.end()) live += EraseEntry(it);
    }
    return live;
  }
  // Every entry at once (an import).
  void Replace(absl::flat_hash_map<int64_t, Entry> entries) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    entries_ = std::move(entries);
    live_rows_ = 0;
    for (const auto& kv : entries_) live_rows_ += kv.second.live;
    DropBuckets();
  }
  // The boundary `step` saw `ids` (their entries' last_seen is `step`): erases every id last seen
  // at or before `through` and returns how many of them had rows. Eviction visits the buckets of
  // the boundaries it ends, not every entry: a step costs its own ids, not the table's size.
  int64_t SeenAndEvict(int64_t step, const int64_t* ids, int64_t n, int64_t through)
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!bucketed_ || bucketed_ids_ > 2 * static_cast<int64_t>(entries_.size())) {
      Bucket();  // each entry once, in its last boundary's bucket: this step's ids included
    } else {
      seen_at_[step].insert(seen_at_[step].end(), ids, ids + n);
      bucketed_ids_ += n;
    }
    int64_t live = 0;
    while (!seen_at_.empty() && seen_at_.begin()->first <= through) {
      const auto& [seen, bucket] = *seen_at_.begin();
      for (int64_t id : bucket) {
        auto it = entries_.find(id);
        if (it != entries_.end() && it->second.last_seen == seen) live += EraseEntry(it);  // else seen since, or gone
      }
      bucketed_ids_ -= static_cast<int64_t>(bucket.size());
      seen_at_.erase(seen_at_.begin());
    }
    return live;
  }
  // A boundary that does not evict keeps no buckets.
  void NoEviction() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) { DropBuckets(); }
  int64_t LiveRows() const TF_SHARED_LOCKS_REQUIRED(mu_) { return live_rows_; }
  // out[0..3]: live rows, boundaries so far, rows admitted, rows evicted.
  void Counters(int64_t* out) const TF_SHARED_LOCKS_REQUIRED(mu_) {
    out[0] = LiveRows();
    out[1] = clock_.step;
    out[2] = clock_.admitted;
    out[3] = clock_.evicted;
  }

 private:
  // Returns whether the entry had a row.
  bool EraseEntry(absl::flat_hash_map<int64_t, Entry>::iterator it) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool live = it->second.live;
    live_rows_ -= live;
    entries_.erase(it);
    return live;
  }
  void DropBuckets() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    seen_at_.clear();
    bucketed_ids_ = 0;
    bucketed_ = false;
  }
  void Bucket() TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    seen_at_.clear();
    for (const auto& kv : entries_) seen_at_[kv.second.last_seen].push_back(kv.first);
    bucketed_ids_ = static_cast<int64_t>(entries_.size());
    bucketed_ = true;
  }

  const int64_t dim_;
  const std::string name_;
  absl::Mutex mu_;
  int64_t slots_ TF_GUARDED_BY(mu_) = -1;
  absl::flat_hash_map<int64_t, Entry> entries_ TF_GUARDED_BY(mu_);
  Clock clock_ TF_GUARDED_BY(mu_);
  int64_t live_rows_ TF_GUARDED_BY(mu_) = 0;
  // ids by a boundary that saw them (an id may sit in older buckets too: its entry's last_seen
  // tells); kept only while boundaries evict
  std::map<int64_t, std::vector<int64_t>> seen_at_ TF_GUARDED_BY(mu_);
  int64_t bucketed_ids_ TF_GUARDED_BY(mu_) = 0;
  bool bucketed_ TF_GUARDED_BY(mu_) = false;
};

// The rule's step on one row: `row` and `slot[k]` point at dim floats each, `grad` too;
// `step`: the boundaries the table saw before.
inline void ApplyRule(const Rule& rule, int64_t dim, int64_t step, const float* grad, float* row,
                      const std::vector<float*>& slot) {
  const std::vector<float>& h = rule.hyper;
  switch (rule.kind) {
    case RuleKind::kSgd:
      for (int64_t j = 0; j < dim; ++j) row[j] -= h[0] * grad[j];
      return;
    case RuleKind::kMomentum:  // learning_rate, momentum
      for (int64_t j = 0; j < dim; ++j) {
        const float accum = slot[0][j] * h[1] + grad[j];
        slot[0][j] = accum;
        row[j] -= rule.nesterov ? grad[j] * h[0] + accum * h[1] * h[0] : accum * h[0];
      }
      return;
    case RuleKind::kAdagrad:  // learning_rate
      for (int64_t j = 0; j < dim; ++j) {
        const float accum = slot[0][j] + grad[j] * grad[j];
        slot[0][j] = accum;
        row[j] -= h[0] * grad[j] * (1.0f / std::sqrt(accum));
      }
      return;
    case RuleKind::kAdam: {  // learning_rate, beta1, beta2, epsilon; bias correction in float64
      const double t = static_cast<double>(step + 1);
      const float b1_power = static_cast<float>(std::pow(static_cast<double>(h[1]), t));
      const float b2_power = static_cast<float>(std::pow(static_cast<double>(h[2]), t));
      const float lr_t = h[0] * std::sqrt(1.0f - b2_power) / (1.0f - b1_power);
      for (int64_t j = 0; j < dim; ++j) {
        const float m = slot[0][j] * h[1] + grad[j] * (1.0f - h[1]);
        const float v = slot[1][j] * h[2] + grad[j] * grad[j] * (1.0f - h[2]);
        slot[0][j] = m;
        slot[1][j] = v;
        row[j] -= lr_t * m / (std::sqrt(v) + h[3]);
      }
      return;
    }
    case RuleKind::kFtrl: {  // learning_rate, l1, l2, beta, l2_shrinkage
      const float lr = h[0], l1 = h[1], l2 = h[2] + h[3] / (2.0f * lr), shrinkage = h[4];
      const float power = rule.learning_rate_power;
      for (int64_t j = 0; j < dim; ++j) {
        const float accum = slot[0][j], new_accum = accum + grad[j] * grad[j];
        const float shrunk = grad[j] + 2.0f * shrinkage * row[j];
        float linear = slot[1][j], quadratic;
        if (power == -0.5f) {
          linear = linear + shrunk - (std::sqrt(new_accum) - std::sqrt(accum)) / lr * row[j];
          quadratic = std::sqrt(new_accum) / lr + 2.0f * l2;
        } else {
          linear = linear + shrunk - (std::pow(new_accum, -power) - std::pow(accum, -power)) / lr * row[j];
          quadratic = std::pow(new_accum, -power) / lr + 2.0f * l2;
        }
        const float sign = linear > 0 ? 1.0f : (linear < 0 ? -1.0f : 0.0f);
        row[j] = std::fabs(linear) > l1 ? (l1 * sign - linear) / quadratic : 0.0f;
        slot[0][j] = new_accum;
        slot[1][j] = linear;
      }
      return;
    }
  }
}

// How many hyper-parameters each kind takes, in ApplyRule's order.
inline int HyperCount(RuleKind kind) {
  switch (kind) {
    case RuleKind::kSgd: return 1;
    case RuleKind::kMomentum: return 2;
    case RuleKind::kAdagrad: return 1;
    case RuleKind::kAdam: return 4;
    case RuleKind::kFtrl: return 5;
  }
  return 0;
}

// The step boundary of one shard (parallax_tf/dynamic/store.py's Shard.boundary): for each of
// the step's distinct ids, its occurrences and last step seen; admission (admit_after 1: a new id
// starts from its initial row and slots and trains this step; k > 1: an id reaching k occurrences
// gets its initial row without this step's gradient); the rule on the live rows and slots; then
// eviction of ids unseen for evict_after steps (-1: none), and the clock.
struct Boundary {
  Rule rule;
  int64_t admit_after, evict_after;
  std::vector<float> slot_initial;

  // `initial(i, row)` writes the initial row of ids[i]. The caller holds the shard's lock.
  template <typename InitialRow>
  absl::Status Run(KvShard* shard, int64_t n, const int64_t* id, const float* grad, const int64_t* count,
                   InitialRow initial) const TF_EXCLUSIVE_LOCKS_REQUIRED(shard->mu()) {
    const int64_t dim = shard->dim(), slots = static_cast<int64_t>(slot_initial.size());
    TF_RETURN_IF_ERROR(shard->FixSlots(slots));
    auto& entries = shard->entries();
    Clock& clock = shard->clock();
    const int64_t step = clock.step;
    int64_t admitted = 0;
    std::vector<float*> slot(slots);
    for (int64_t i = 0; i < n; ++i) {
      Entry& e = entries[id[i]];
      const bool was_live = e.live;
      e.count += count[i];
      const bool admit = !was_live && (admit_after == 1 || e.count >= admit_after);
      if (admit) {  // the initial row, each slot at its start
        e.data.resize((1 + slots) * dim);
        initial(i, e.data.data());
        for (int64_t k = 0; k < slots; ++k)
          std::fill(e.data.begin() + (1 + k) * dim, e.data.begin() + (2 + k) * dim, slot_initial[k]);
        ++admitted;
      }
      // live ids train; with admission on first use a new id trains from its initial row
      if (was_live || (admit && admit_after == 1)) {
        for (int64_t k = 0; k < slots; ++k) slot[k] = e.data.data() + (1 + k) * dim;
        ApplyRule(rule, dim, step, grad + i * dim, e.data.data(), slot);
      }
      e.live = was_live || admit;
      e.last_seen = step;
    }
    shard->AddLive(admitted);
    int64_t evicted = 0;
    if (evict_after >= 0) {
      evicted = shard->SeenAndEvict(step, id, n, step - evict_after);
    } else {
      shard->NoEviction();
    }
    clock = Clock{step + 1, clock.admitted + admitted, clock.evicted + evicted};
    return absl::OkStatus();
  }
};

// The shapes a shard's ops take: ids a vector, rows [n, dim].
inline absl::Status CheckIds(const tensorflow::Tensor& ids, const char* op) {
  if (ids.dims() != 1) return Invalid(op, ": ids must be a vector, got ", ids.shape().DebugString());
  return absl::OkStatus();
}

inline absl::Status CheckRows(const tensorflow::Tensor& rows, int64_t n, int64_t dim, const char* op,
                              const char* what) {
  if (rows.dims() != 2 || rows.dim_size(0) != n || rows.dim_size(1) != dim)
    return Invalid(op, ": ", what, " must be [", n, ", ", dim, "], got ", rows.shape().DebugString());
  return absl::OkStatus();
}

}  // namespace parallax

#endif  // PARALLAX_TF_OPS_KV_SHARD_H_
