"""One rank of a trainer world that torchrun started (tests/service/test_trainer_world.py): joins the world as the
trainer does and writes what every rank sees to the file named by its argument."""

import json
import sys

import torch.distributed as dist

from areal_k8s.trainer.world import World, WorldSpec, gather_from_ranks

spec = WorldSpec.from_env()
world = World(spec).join("cpu")
seen = gather_from_ranks(
    {"rank": spec.rank, "local_rank": spec.local_rank, "size": spec.size, "grpc_port": spec.port_for(50054)}
)
if world.leads:
    with open(sys.argv[1], "w") as out:
        json.dump(seen, out)
dist.barrier()
dist.destroy_process_group()
