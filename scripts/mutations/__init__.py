"""Every mutation scripts/mutate.py runs, one module per area of the package.

Add a mutation to the module of the area its source belongs to.
"""

from mutations import checkpoints, compact, compat, core, offload_engine, planning, streaming
from mutations.base import Mutation

MUTATIONS: list[Mutation] = [
    *core.MUTATIONS,
    *compact.MUTATIONS,
    *checkpoints.MUTATIONS,
    *streaming.MUTATIONS,
    *planning.MUTATIONS,
    *offload_engine.MUTATIONS,
    *compat.MUTATIONS,
]

__all__ = ["MUTATIONS", "Mutation"]
