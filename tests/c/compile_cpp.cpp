// mscclpp.h from strict C++17 (-Wall -Wextra -Wpedantic -Werror): the 2023 six-argument
// mscclppConnect, the device methods' host paths and the trigger encoder, linked against the
// library and run. Needs no peer.
#include <mscclpp.h>

#include <cstdio>
#include <cstring>

static int failures;

#define EXPECT(cond)                                                                     \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__,   \
                   #cond, mscclppGetLastError());                                        \
      failures++;                                                                        \
    }                                                                                    \
  } while (0)

int main()
{
  char buf[64] = {};
  mscclppComm_t comm = nullptr;

  // 2023 call with ibDev left out (C++ default argument).
  EXPECT(mscclppConnect(comm, 1, 0, buf, sizeof buf, mscclppTransportP2P) ==
         mscclppInvalidArgument);
  EXPECT(std::strstr(mscclppGetLastError(), "comm") != nullptr);
  EXPECT(mscclppConnect(comm, 1, 0, buf, sizeof buf, mscclppTransportIB, "dev0") ==
         mscclppInvalidArgument);

  // The methods' host paths reach the C functions: a connection that the library did not
  // create is refused (and logged), never dereferenced.
  mscclppDevConnSignalEpochId epoch = {};
  uint64_t waitEpoch = 0;
  mscclppDevConn conn = {};
  conn.localSignalEpochId = &epoch;
  conn.waitEpochId = &waitEpoch;
  // The block methods' host paths are put() and putWithSignal() (each call changes the last
  // error, so every check below sees its own call).
  const char* const calls[] = {"mscclppDevConnPut", "mscclppDevConnSignal",
                               "mscclppDevConnPutWithSignal",
                               "mscclppDevConnPutWithSignalAndFlush", "mscclppDevConnFlush",
                               "mscclppDevConnWait", "mscclppDevConnPut",
                               "mscclppDevConnPutWithSignal"};
  for (int i = 0; i < 8; i++) {
    switch (i) {
    case 0: conn.put(0, 8); break;
    case 1: conn.signal(); break;
    case 2: conn.putWithSignal(0, 8); break;
    case 3: conn.putWithSignalAndFlush(0, 0, 8); break;
    case 4: conn.flush(); break;
    case 5: conn.wait(); break;
    case 6: conn.putBlock(0, 0, 8); break;
    case 7: conn.putWithSignalBlock(0, 0, 8); break;
    }
    EXPECT(std::strstr(mscclppGetLastError(), calls[i]) != nullptr);
  }
  conn.epochIncrement();
  EXPECT(epoch.device == 1 && epoch.proxy == 0 && waitEpoch == 0);

  // Trigger words as docs/DESIGN.md lays them out.
  uint64_t w[2];
  mscclppConcurrentFifo::encodeTrigger(w, mscclppData | mscclppFlag, 0x30, 0x20, 0x10, 5);
  EXPECT(w[0] == (0x10ull | (0x20ull << 32)));
  EXPECT(w[1] == (0x30ull | (5ull << 32) | (3ull << 42)));

  if (failures) {
    std::fprintf(stderr, "compile_cpp: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("compile_cpp: all checks passed\n");
  return 0;
}
