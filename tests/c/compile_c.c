/* mscclpp.h from strict C11 (-Wall -Wextra -Wpedantic -Werror): the types, the 2023 layout
 * (_Static_assert) and the calls that need no peer, linked against the library and run. */
#include <mscclpp.h>

#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

_Static_assert(sizeof(struct mscclppDevConn) == 80, "mscclppDevConn is 80 bytes");
_Static_assert(offsetof(mscclppDevConn_t, fifo) == 48, "fifo at offset 48");
_Static_assert(sizeof(mscclppDevConnSignalEpochId) == 16, "epoch size");
_Static_assert(alignof(mscclppDevConnSignalEpochId) == 16, "epoch alignment");
_Static_assert(alignof(struct mscclppTrigger) == 16, "trigger alignment");
_Static_assert(sizeof(mscclppUniqueId) == MSCCLPP_UNIQUE_ID_BYTES, "unique id size");
_Static_assert(mscclppNumResults == 8 && mscclppTransportIB == 2, "enum values");

static int failures;

#define EXPECT(cond)                                                                     \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              mscclppGetLastError());                                                    \
      failures++;                                                                        \
    }                                                                                    \
  } while (0)

static int logged;

static void count_log(const char *msg)
{
  (void)msg;
  logged++;
}

int main(void)
{
  int version = -1;
  char buf[16];
  mscclppComm_t comm = NULL;
  mscclppDevConn_t *conns = NULL;
  int n = -1;
  mscclppLogHandler_t handler = count_log;

  EXPECT(mscclppGetVersion(&version) == mscclppSuccess);
  EXPECT(version == MSCCLPP_VERSION);
  EXPECT(strcmp(mscclppGetErrorString(mscclppSuccess), "no error") == 0);
  EXPECT(strcmp(mscclppGetErrorString(mscclppInvalidArgument), "invalid argument") == 0);
  EXPECT(strcmp(mscclppGetErrorString((mscclppResult_t)1234), "unknown result code") == 0);

  /* NULL is fine for destroy; a missing communicator is an invalid argument elsewhere. */
  EXPECT(mscclppCommDestroy(NULL) == mscclppSuccess);
  EXPECT(mscclppSetLogHandler(handler) == mscclppSuccess);
  EXPECT(mscclppConnect(comm, 1, 0, buf, sizeof buf, mscclppTransportIB, NULL) ==
         mscclppInvalidArgument);
  EXPECT(strstr(mscclppGetLastError(), "mscclppConnect") != NULL);
  EXPECT(logged > 0);
  EXPECT(mscclppSetLogHandler(NULL) == mscclppSuccess);
  EXPECT(mscclppConnect(comm, 1, 0, buf, sizeof buf, (mscclppTransport_t)77, NULL) ==
         mscclppInvalidArgument);
  EXPECT(mscclppGetAllDeviceConnections(comm, &conns, &n) == mscclppInvalidArgument);
  EXPECT(conns == NULL && n == -1); /* outputs untouched on failure */
  EXPECT(mscclppCommInitRank(NULL, 2, "127.0.0.1:1", 0) == mscclppInvalidArgument);
  EXPECT(mscclppCommInitRank(&comm, 2, "127.0.0.1:1", 5) == mscclppInvalidArgument);
  EXPECT(comm == NULL);

  if (failures) {
    fprintf(stderr, "compile_c: %d check(s) failed\n", failures);
    return 1;
  }
  printf("compile_c: all checks passed\n");
  return 0;
}
