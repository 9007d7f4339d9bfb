"""Rank, number of ranks, local rank and root address from the launcher's environment.

The same rules as the C examples' ``c_examples/common/launch_env.h``; the first launcher whose
two variables are both set wins, torchrun first when its own marker ``TORCHELASTIC_RUN_ID`` is
set (it runs inside the others: under ``srun torchrun`` or an ``sbatch`` script that runs
torchrun, every worker also inherits the Slurm task's ``SLURM_PROCID``/``SLURM_NTASKS``, which
name the node's task, not the worker):

=============================  ==================  ======================  =======================
launcher                       rank                number of ranks         local rank
=============================  ==================  ======================  =======================
scripts/run-local-ranks.sh     MSCCLPP_RANK        MSCCLPP_NRANKS          MSCCLPP_LOCAL_RANK
torchrun (TORCHELASTIC_RUN_ID) RANK                WORLD_SIZE              LOCAL_RANK
Open MPI's mpirun              OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE   OMPI_COMM_WORLD_LOCAL_RANK
MPICH / Intel MPI (hydra)      PMI_RANK            PMI_SIZE                MPI_LOCALRANKID
Slurm's srun                   SLURM_PROCID        SLURM_NTASKS            SLURM_LOCALID
torchrun                       RANK                WORLD_SIZE              LOCAL_RANK
=============================  ==================  ======================  =======================

Root address (``ip:port`` of rank 0's bootstrap): the argument, else ``MSCCLPP_ROOT``, else
``MASTER_ADDR:(MASTER_PORT + 1)`` (torchrun's own store listens on MASTER_PORT itself). The
local rank defaults to the rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

# (rank, nranks, local rank, name, a variable that must also be set, or None). torchrun's
# RANK/WORLD_SIZE come second when torchrun's marker says it launched us (it is then the
# innermost launcher); without the marker they are plain names other tools set too, so last.
_LAUNCHERS = (
    ("MSCCLPP_RANK", "MSCCLPP_NRANKS", "MSCCLPP_LOCAL_RANK", "MSCCLPP_RANK/MSCCLPP_NRANKS", None),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun", "TORCHELASTIC_RUN_ID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun", None),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PMI", None),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "Slurm", None),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun", None),
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process stands in the job: its rank, the number of ranks, its local rank
    (the GPU to use is usually ``local_rank % device_count``), rank 0's bootstrap address, and
    which launcher's variables said so."""

    rank: int
    nranks: int
    local_rank: int
    root: str
    source: str


def _int(name: str, value: Optional[str]) -> int:
    if value is None or not value.strip().isdigit():
        raise ValueError(f"{name}={value!r}: not a non-negative integer")
    return int(value)


def launch_env(root: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Reads the launcher's variables (see the module's table).

    Args:
        root: rank 0's ``ip:port``; overrides ``MSCCLPP_ROOT`` and ``MASTER_ADDR``/``MASTER_PORT``.
        environ: the variables to read (default ``os.environ``).

    Raises:
        ValueError: no launcher's variables, values that are not integers, rank >= nranks, or no
            root address.
    """
    env = os.environ if environ is None else environ
    for rank_var, size_var, local_var, source, marker in _LAUNCHERS:
        if rank_var in env and size_var in env and (marker is None or marker in env):
            rank = _int(rank_var, env[rank_var])
            nranks = _int(size_var, env[size_var])
            local = _int(local_var, env[local_var]) if env.get(local_var) else rank
            break
    else:
        raise ValueError(
            "no launcher variables: run under torchrun, mpirun, srun or scripts/run-local-ranks.sh "
            "(RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_*, MSCCLPP_RANK/MSCCLPP_NRANKS)"
        )
    if nranks <= 0 or rank >= nranks:
        raise ValueError(f"need 0 <= rank < nranks (got rank {rank}, nranks {nranks} from {source})")
    if root is None:
        root = env.get("MSCCLPP_ROOT")
    if root is None:
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not addr or port is None:
            raise ValueError(
                "no root address: pass root='ip:port' or set MSCCLPP_ROOT (or MASTER_ADDR and MASTER_PORT)"
            )
        p = _int("MASTER_PORT", port)
        if p >= 65535:
            raise ValueError(f"MASTER_PORT={port}: no port above it for the bootstrap")
        host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
        root = f"{host}:{p + 1}"
    return LaunchEnv(rank, nranks, local, root, source)
