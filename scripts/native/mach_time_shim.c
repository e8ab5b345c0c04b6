/* mlx-rs seeds RandomState::new() from macOS's mach_approximate_time(); on
 * Linux the same role is played by CLOCK_MONOTONIC in nanoseconds. */
#include <stdint.h>
#include <time.h>

uint64_t mach_approximate_time(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}
