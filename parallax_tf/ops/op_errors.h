// What every kernel of parallax_tf's ops reports a bad input with: one InvalidArgument status
// whose message is the arguments concatenated (absl::StrCat).
#ifndef PARALLAX_TF_OPS_OP_ERRORS_H_
#define PARALLAX_TF_OPS_OP_ERRORS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace parallax {

template <typename... Args>
absl::Status Invalid(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

}  // namespace parallax

#endif  // PARALLAX_TF_OPS_OP_ERRORS_H_
