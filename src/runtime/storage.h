// Internal: FSDP-style storage release (registry.cpp). A route frees the bytes of a parameter it
// does not hold between uses by resizing its StorageImpl, so every view and saved tensor sees the
// memory come and go.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>

namespace dmuon::detail {
// resize a tensor's StorageImpl in place (every view and saved tensor sees it)
void resize_storage_bytes(const at::Tensor& t, size_t bytes);
void restore_storage(const at::Tensor& t);  // resize back to the tensor's full size
}  // namespace dmuon::detail
