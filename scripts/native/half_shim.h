/* Force-included into mlx-c (C++) and into bindgen's view of its headers (C).
 * mlx-c's half.h declares float16_t/bfloat16_t only on ARM, which drops the
 * four mlx_array_{item,data}_{float16,bfloat16} functions that mlx-rs calls.
 * Off ARM we declare them here: MLX's own half types for C++, and 16-bit
 * storage types for C, shaped as mlx-rs expects (float16_t wraps a u16,
 * bfloat16_t is a u16). */
#ifndef DRAFTER_HOST_HALF_SHIM_H
#define DRAFTER_HOST_HALF_SHIM_H
#if !defined(__ARM_FEATURE_FP16_SCALAR_ARITHMETIC) && !defined(__aarch64__)
#define HAS_FLOAT16
#define HAS_BFLOAT16
#ifdef __cplusplus
#include "mlx/types/half_types.h"
typedef mlx::core::float16_t float16_t;
typedef mlx::core::bfloat16_t bfloat16_t;
#else
typedef __fp16 float16_t;
typedef unsigned short bfloat16_t;
#endif
#endif
#endif
