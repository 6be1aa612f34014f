// A dynamic table's per-id uniforms (parallax_tf/dynamic/ids.py): element j of id i is
// splitmix64(splitmix64(i ^ salt) + (j + 1) * golden) >> 11, scaled to [0, 1), and the initial
// row laws computed from them in the same double operations as ids.py's standard-op forms, so
// a compiled op and a served model's standard ops give the same rows bit for bit.
#ifndef PARALLAX_TF_OPS_ID_HASH_H_
#define PARALLAX_TF_OPS_ID_HASH_H_

#include <cstdint>
#include <string>

namespace parallax {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The shard of `shards` that holds `id`'s row (ids.py's `owner`).
inline int64_t Owner(int64_t id, int64_t shards) {
  return static_cast<int64_t>(Mix(static_cast<uint64_t>(id) + kGolden) % static_cast<uint64_t>(shards));
}

// The uniforms of one id: u[j] for j < dim.
inline void IdUniforms(int64_t id, uint64_t salt, int64_t dim, double* u) {
  const uint64_t base = Mix(static_cast<uint64_t>(id) ^ salt);
  for (int64_t j = 0; j < dim; ++j) {
    const uint64_t bits = Mix(base + static_cast<uint64_t>(j + 1) * kGolden);
    u[j] = static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
  }
}

// An initial row law that is an affine function of the id's uniforms (ids.uniform,
// initializers.uniform_range, ids.constant), with ids.py's operations in its order.
struct RowLaw {
  enum Kind { kUniform, kRange, kConstant } kind;
  double a, b;     // uniform: scale; range: minval, maxval - minval; constant: value
  uint64_t salt;

  static bool Parse(const std::string& name, Kind* kind) {
    if (name == "uniform") *kind = kUniform;
    else if (name == "range") *kind = kRange;
    else if (name == "constant") *kind = kConstant;
    else return false;
    return true;
  }

  // `dim` floats of `id`'s initial row; `u`: room for dim doubles.
  void Row(int64_t id, int64_t dim, double* u, float* row) const {
    if (kind == kConstant) {
      for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<float>(a);
      return;
    }
    IdUniforms(id, salt, dim, u);
    for (int64_t j = 0; j < dim; ++j)
      row[j] = static_cast<float>(kind == kUniform ? (2.0 * u[j] - 1.0) * a : a + b * u[j]);
  }
};

}  // namespace parallax

#endif  // PARALLAX_TF_OPS_ID_HASH_H_
