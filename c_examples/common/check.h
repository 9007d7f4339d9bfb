/*
 * check.h: error checking for the examples in c_examples/. Header-only C11.
 *
 *   MSCCLPP_CHECK_GOTO(call, label)
 *     runs an API call; on failure prints the call, its result code and text, and the
 *     library's last error message for this thread, then jumps to `label`.
 *   example_rank: set it once the rank is known; it prefixes every message.
 */
#ifndef MSCCLPP_EXAMPLES_CHECK_H_
#define MSCCLPP_EXAMPLES_CHECK_H_

#include <mscclpp.h>
#include <stdio.h>

static int example_rank = -1;

static int example_failed(mscclppResult_t res, const char *call, const char *file, int line)
{
  if (res == mscclppSuccess) {
    return 0;
  }
  fprintf(stderr, "[rank %d] %s:%d: %s failed: %s (%d): %s\n", example_rank, file, line, call,
          mscclppGetErrorString(res), (int)res, mscclppGetLastError());
  return 1;
}

#define MSCCLPP_CHECK_GOTO(call, label)                            \
  do {                                                             \
    if (example_failed((call), #call, __FILE__, __LINE__)) {       \
      goto label;                                                  \
    }                                                              \
  } while (0)

#endif /* MSCCLPP_EXAMPLES_CHECK_H_ */
