#pragma once

// The one status-macro header. Both macros return from the calling function, which must return
// the type of `expr`.

// Unless `expr` (a status object with ok(): absl::Status, cuda::GroupStatus) is OK, returns it.
#define ROLLOUT_RETURN_IF_ERROR(expr)  \
  do {                                 \
    auto _status = (expr);             \
    if (!_status.ok()) return _status; \
  } while (0)

// Unless `expr` (a status code: cudaError_t, cublasStatus_t) equals `success`, returns it.
#define ROLLOUT_RETURN_IF_FAILED(expr, success) \
  do {                                          \
    const auto _code = (expr);                  \
    if (_code != (success)) return _code;       \
  } while (0)
