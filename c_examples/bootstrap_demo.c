/*
 * bootstrap_demo: N processes form a communicator through the TCP bootstrap, all-gather their
 * host names over it, meet at a barrier, print what they gathered and destroy the
 * communicator. No GPU needed.
 *
 *   scripts/run-local-ranks.sh 4 ./bootstrap_demo          4 ranks on this host
 *   ./bootstrap_demo -r 0 -n 2 -a 10.0.0.1:50000 & ...     by hand, one process per rank
 *   mpirun -np 4 -x MSCCLPP_ROOT=10.0.0.1:50000 ./bootstrap_demo
 *
 * Rank, size and root address come from the command line or the launcher's environment
 * (common/launch_env.h). Exit status 0 when every check passed on this rank.
 */
#define _POSIX_C_SOURCE 200809L

#include <mscclpp.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "launch_env.h"

/* Bytes each rank contributes: its host name and process id, NUL-terminated. */
#define NAME_BYTES 128

int main(int argc, char **argv)
{
  launch_env env;
  mscclppComm_t comm = NULL;
  char *names = NULL;
  char host[64] = "";
  char mine[NAME_BYTES];
  int rank = -1, nranks = -1, rc = 1;

  if (launch_env_parse(&argc, argv, &env) != 0) {
    return 2;
  }
  if (argc > 1) {
    fprintf(stderr, "%s: unexpected argument '%s'\n", argv[0], argv[1]);
    return 2;
  }
  example_rank = env.rank;
  if (gethostname(host, sizeof host - 1) != 0) {
    strcpy(host, "unknown-host");
  }
  snprintf(mine, sizeof mine, "%s (pid %ld)", host, (long)getpid());
  names = calloc((size_t)env.nranks, NAME_BYTES);
  if (names == NULL) {
    fprintf(stderr, "[rank %d] out of memory\n", env.rank);
    return 1;
  }
  if (env.rank == 0) {
    printf("bootstrap_demo: %d ranks, root %s (rank and size from %s)\n", env.nranks, env.root,
           env.source);
    fflush(stdout);
  }

  MSCCLPP_CHECK_GOTO(mscclppCommInitRank(&comm, env.nranks, env.root, env.rank), out);
  MSCCLPP_CHECK_GOTO(mscclppCommRank(comm, &rank), out);
  MSCCLPP_CHECK_GOTO(mscclppCommSize(comm, &nranks), out);
  if (rank != env.rank || nranks != env.nranks) {
    fprintf(stderr, "[rank %d] communicator says rank %d of %d, expected %d of %d\n", env.rank,
            rank, nranks, env.rank, env.nranks);
    goto out;
  }

  memcpy(names + (size_t)rank * NAME_BYTES, mine, NAME_BYTES);
  MSCCLPP_CHECK_GOTO(mscclppBootstrapAllGather(comm, names, NAME_BYTES), out);
  for (int r = 0; r < nranks; r++) {
    const char *name = names + (size_t)r * NAME_BYTES;
    if (memchr(name, '\0', NAME_BYTES) == NULL || name[0] == '\0') {
      fprintf(stderr, "[rank %d] all-gather: nothing from rank %d\n", rank, r);
      goto out;
    }
  }
  if (memcmp(names + (size_t)rank * NAME_BYTES, mine, NAME_BYTES) != 0) {
    fprintf(stderr, "[rank %d] all-gather overwrote this rank's own entry\n", rank);
    goto out;
  }
  MSCCLPP_CHECK_GOTO(mscclppBootstrapBarrier(comm), out);

  if (rank == 0) {
    for (int r = 0; r < nranks; r++) {
      printf("  rank %d: %s\n", r, names + (size_t)r * NAME_BYTES);
    }
  }
  printf("rank %d/%d: all-gather of %d host names and barrier OK\n", rank, nranks, nranks);
  rc = 0;

out:
  if (comm != NULL && example_failed(mscclppCommDestroy(comm), "mscclppCommDestroy(comm)",
                                     __FILE__, __LINE__)) {
    rc = 1;
  }
  free(names);
  return rc;
}
