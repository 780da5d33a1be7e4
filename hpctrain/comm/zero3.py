"""--zero 3's collective outside the step's buckets: the parameters live in
shards (nn/sharded_store.ParamShard: this rank's part of each of ring
mode's buckets, in the sharded optimizer's compact layout), so whatever
needs them whole takes them a bucket at a time. `Gatherer`: a bucket's
parameters into its slot before its layers run (this rank's part copied
in, then the strategy's allgather: the same ring, the same deadline and
the same named stall as stage 1's gather after the update). Checkpoints
and --save go by each rank's own parts (state/layouts.py).

    mpirun -n 2 python -m mpi4py -m pytest --only-mpi tests/test_zero3.py
"""


class Gatherer:
    """gather(j, view): bucket j's parameters into `view` (its slot): this
    rank's part from the shard, the others' by the strategy's allgather."""

    def __init__(self, strategy, shard, xp, timeline=None):
        self.strategy, self.shard, self.xp, self.timeline = strategy, shard, xp, timeline

    def __call__(self, j, view):
        lo = self.shard.buckets[j][0]
        a, b = self.shard.owned[j]
        self.xp.copyto(view[a - lo:b - lo], self.shard.part(j))
        if self.timeline is None:
            self.strategy.allgather(view)
            return
        with self.timeline.span(f"allgather [{lo}:{lo + view.size})", cat="comm", bytes=int(view.nbytes)):
            self.strategy.allgather(view)
