/*
 * launch_env.h: rank, number of ranks and root address of an example process, from its
 * command line or from the environment its launcher sets. Header-only C11; shared by the
 * examples in c_examples/.
 *
 * Options (removed from argv; they override the environment):
 *   -r RANK   -n NRANKS   -a IP:PORT (rank 0's bootstrap address)   -l LOCAL_RANK   -h
 *
 * Environment, the first launcher found wins (torchrun second, when its marker
 * TORCHELASTIC_RUN_ID is set: it runs inside the others, e.g. `srun torchrun`, whose workers
 * also inherit the Slurm task's SLURM_PROCID/SLURM_NTASKS; without it, RANK/WORLD_SIZE last):
 *   MSCCLPP_RANK, MSCCLPP_NRANKS, MSCCLPP_LOCAL_RANK     scripts/run-local-ranks.sh
 *   RANK, WORLD_SIZE, LOCAL_RANK + TORCHELASTIC_RUN_ID   torchrun
 *   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK             Open MPI's mpirun
 *   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID                  MPICH / Intel MPI (hydra)
 *   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID            Slurm's srun
 *   RANK, WORLD_SIZE, LOCAL_RANK                         torchrun
 * Root address: -a, else MSCCLPP_ROOT, else MASTER_ADDR:(MASTER_PORT + 1) as torchrun sets
 * them (torchrun's own store listens on MASTER_PORT itself).
 * The local rank (the GPU to use) defaults to the rank.
 */
#ifndef MSCCLPP_EXAMPLES_LAUNCH_ENV_H_
#define MSCCLPP_EXAMPLES_LAUNCH_ENV_H_

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct launch_env {
  int rank;
  int nranks;
  int local_rank;
  char root[256];     /* "ip:port", "host:port" or "[ipv6]:port" of rank 0 */
  const char *source; /* where rank and nranks came from, for messages */
} launch_env;

/* Parses a non-negative decimal int; -1 if `s` is NULL, empty or not one. */
static int launch_env_int(const char *s)
{
  char *end;
  long v;
  if (s == NULL || *s == '\0') {
    return -1;
  }
  errno = 0;
  v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < 0 || v > INT_MAX) {
    return -1;
  }
  return (int)v;
}

static void launch_env_usage(const char *prog)
{
  fprintf(stderr,
          "usage: %s [-r RANK -n NRANKS] [-a IP:PORT] [-l LOCAL_RANK]\n"
          "  rank and size also come from mpirun, srun, torchrun or scripts/run-local-ranks.sh\n"
          "  (OMPI_COMM_WORLD_*, PMI_*, SLURM_*, RANK/WORLD_SIZE, MSCCLPP_RANK/MSCCLPP_NRANKS);\n"
          "  the root address from MSCCLPP_ROOT or MASTER_ADDR/MASTER_PORT.\n",
          prog);
}

/* Fills *env from the options in argv[1..*argc) and the environment. Recognised options are
 * removed from argv (and *argc lowered), so the caller sees only its own arguments. Returns 0,
 * or -1 after printing the reason and the usage to stderr (also for -h). */
static int launch_env_parse(int *argc, char **argv, launch_env *env)
{
  /* marker: a variable that must be set too (NULL: none); see the header comment. */
  static const struct {
    const char *rank, *nranks, *local, *source, *marker;
  } launchers[] = {
      {"MSCCLPP_RANK", "MSCCLPP_NRANKS", "MSCCLPP_LOCAL_RANK", "MSCCLPP_RANK/MSCCLPP_NRANKS", NULL},
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun", "TORCHELASTIC_RUN_ID"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun", NULL},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PMI", NULL},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "Slurm", NULL},
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun", NULL},
  };
  const char *prog = argv[0] ? argv[0] : "example";
  const char *root = NULL;
  int cli_rank = -1, cli_nranks = -1, cli_local = -1, out = 1;
  size_t i;

  memset(env, 0, sizeof *env);
  env->rank = env->nranks = env->local_rank = -1;
  env->source = "nowhere";

  for (int a = 1; a < *argc; a++) {
    const char *opt = argv[a];
    int *target = NULL;
    if (strcmp(opt, "-h") == 0 || strcmp(opt, "--help") == 0) {
      launch_env_usage(prog);
      return -1;
    }
    if (strcmp(opt, "-r") == 0) {
      target = &cli_rank;
    } else if (strcmp(opt, "-n") == 0) {
      target = &cli_nranks;
    } else if (strcmp(opt, "-l") == 0) {
      target = &cli_local;
    } else if (strcmp(opt, "-a") != 0) {
      argv[out++] = argv[a]; /* not ours: keep it for the caller */
      continue;
    }
    if (a + 1 >= *argc) {
      fprintf(stderr, "%s: option %s needs a value\n", prog, opt);
      launch_env_usage(prog);
      return -1;
    }
    a++;
    if (target == NULL) {
      root = argv[a];
    } else if ((*target = launch_env_int(argv[a])) < 0) {
      fprintf(stderr, "%s: option %s: '%s' is not a non-negative integer\n", prog, opt, argv[a]);
      return -1;
    }
  }
  *argc = out;
  argv[out] = NULL;

  for (i = 0; i < sizeof launchers / sizeof launchers[0]; i++) {
    const char *r = getenv(launchers[i].rank), *n = getenv(launchers[i].nranks);
    if (r != NULL && n != NULL && (launchers[i].marker == NULL || getenv(launchers[i].marker) != NULL)) {
      env->rank = launch_env_int(r);
      env->nranks = launch_env_int(n);
      env->local_rank = launch_env_int(getenv(launchers[i].local));
      env->source = launchers[i].source;
      if (env->rank < 0 || env->nranks < 0) {
        fprintf(stderr, "%s: %s=%s, %s=%s: not non-negative integers\n", prog,
                launchers[i].rank, r, launchers[i].nranks, n);
        return -1;
      }
      break;
    }
  }
  if (cli_rank >= 0 || cli_nranks >= 0) {
    env->source = "the command line";
  }
  if (cli_rank >= 0) {
    env->rank = cli_rank;
  }
  if (cli_nranks >= 0) {
    env->nranks = cli_nranks;
  }
  if (cli_local >= 0) {
    env->local_rank = cli_local;
  }
  if (env->local_rank < 0) {
    env->local_rank = env->rank;
  }
  if (env->rank < 0 || env->nranks <= 0 || env->rank >= env->nranks) {
    fprintf(stderr, "%s: need 0 <= rank < nranks (got rank %d, nranks %d from %s)\n", prog,
            env->rank, env->nranks, env->source);
    launch_env_usage(prog);
    return -1;
  }

  if (root == NULL) {
    root = getenv("MSCCLPP_ROOT");
  }
  if (root != NULL) {
    if (strlen(root) >= sizeof env->root) {
      fprintf(stderr, "%s: root address too long: %s\n", prog, root);
      return -1;
    }
    strcpy(env->root, root);
  } else {
    const char *addr = getenv("MASTER_ADDR");
    int port = launch_env_int(getenv("MASTER_PORT"));
    if (addr == NULL || port < 0 || port >= 65535) {
      fprintf(stderr, "%s: no root address: give -a IP:PORT or set MSCCLPP_ROOT "
                      "(or MASTER_ADDR and MASTER_PORT)\n", prog);
      launch_env_usage(prog);
      return -1;
    }
    if (snprintf(env->root, sizeof env->root, "%s:%d", addr, port + 1) >= (int)sizeof env->root) {
      fprintf(stderr, "%s: MASTER_ADDR too long: %s\n", prog, addr);
      return -1;
    }
  }
  return 0;
}

#endif /* MSCCLPP_EXAMPLES_LAUNCH_ENV_H_ */
