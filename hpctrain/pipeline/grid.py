"""The pipeline's grid: the world as P stages x R replicas, and its two kinds
of communicator. Takes a communicator; never imports MPI itself.

Stage s is world ranks [s R, (s + 1) R): the R replicas of one stage are
contiguous, so on a launcher that fills nodes in rank order they share a
node, and the stages lie across nodes. The traffic that matches: a stage's
gradient (its whole parameter slice, every step) is averaged over its
replicas inside the node, where links are fast; only the activations of one
micro-batch (batch x width floats) and their gradients cross the slow links
between nodes (Megatron's and DeepSpeed's rule: pipeline across nodes, data
parallel inside).

- `stage_comm`: the R replicas of this rank's stage; their gradients are summed there.
- `pipe_comm`: the P ranks of this rank's replica index, in stage order
  (its rank there is the stage); activations travel there.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --hidden 64,32 --steps 20
"""


class Grid:
    def __init__(self, comm, stages):
        size, rank = comm.Get_size(), comm.Get_rank()
        self.stages, self.replicas = stages, size // stages
        self.stage, self.replica = divmod(rank, self.replicas)
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        self.stage_comm = comm.Split(self.stage, self.replica)
        self.pipe_comm = comm.Split(self.replica, self.stage)

    def role(self, world_rank):
        """A world rank's place on the grid in words, for the watchdog's lines."""
        stage, replica = divmod(world_rank, self.replicas)
        return f"stage {stage}, replica {replica}"

    def world_rank(self, stage, replica=None):
        """The world rank of (stage, replica), this rank's replica by default."""
        return stage * self.replicas + (self.replica if replica is None else replica)

    def free(self):
        self.stage_comm.Free()
        self.pipe_comm.Free()
