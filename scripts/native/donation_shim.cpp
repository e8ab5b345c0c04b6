/* Whether an MLX array is the only holder of its data (MLX's own test before it reuses an
 * input's buffer for an op's output). mlx-c does not expose it; the host's KV cache asks it
 * before writing new slots into the buffer in place rather than copying the whole cache. */
#include <mlx/array.h>

extern "C" bool mlxrs_array_is_donatable(void* array) {
  return static_cast<const mlx::core::array*>(array)->is_donatable();
}
