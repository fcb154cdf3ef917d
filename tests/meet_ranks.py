"""One rank of a job as a launcher starts it (mpirun, srun, torchrun, or variables set by hand): find its place from
the environment, meet the others (rendezvous and links, no NCCL, no GPU), bring every rank's part to rank 0, end.
Rank 0 prints one line per rank it gathered. tests/test_rendezvous.py runs it under real mpirun."""

import os
import sys

import numpy as np

from rawgpu.jobs import job, rendezvous
from rawgpu.jobs.launchers import world_from_environment

world = world_from_environment(os.environ)
if world is None:
    sys.exit("no launcher's variables")
try:
    me = job.meet(world, rendezvous.Identity.of("recipe", "data", "0"), 30.0, print, job.start_meeting(world, 30.0),
                  nccl=False)
except rendezvous.RendezvousError as exc:
    print(f"rawgpu: error: {exc}", file=sys.stderr)
    sys.exit(1)
with me.guard():
    parts = me.gather(([(np.full((2, 2), world.rank, np.float32), np.zeros(2, np.float32))], {}))
    if parts is not None:
        for r, (weights, _) in enumerate(parts):
            print(f"rank {r} of {world.size} ({world.launcher}): part of rank {int(weights[0][0][0, 0])}", flush=True)
me.finish()
me.close()
