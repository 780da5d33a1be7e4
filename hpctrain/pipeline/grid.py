"""The pipeline's grid: the mesh (run/mesh.py) in the pipeline's words, P
stages x R replicas, and its two kinds of communicator. A view: the mesh
makes the communicators and does the rank arithmetic, and frees them.
Never imports MPI itself.

Stage s is world ranks [s R, (s + 1) R) (the mesh's rank order, tensor
axis of size 1): the R replicas of one stage are contiguous, so on a
launcher that fills nodes in rank order they share a node, and the stages
lie across nodes. The traffic that matches: a stage's gradient (its whole
parameter slice, every step) is averaged over its replicas inside the
node, where links are fast; only the activations of one micro-batch (batch
x width floats) and their gradients cross the slow links between nodes
(Megatron's and DeepSpeed's rule: pipeline across nodes, data parallel
inside).

- `stage_comm`: the R replicas of this rank's stage (the mesh's data axis);
  their gradients are summed there.
- `pipe_comm`: the P ranks of this rank's replica index, in stage order
  (the mesh's pipeline axis; its rank there is the stage); activations travel there.
- `tensors`, `tensor`: with --tensor-parallel T, the T ranks that split
  this stage's layers and this rank's place among them (the mesh's tensor
  axis): each sends its copy of the activations to its counterpart of the
  next stage, and whatever goes to or from the chief goes by tensor rank 0.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --hidden 64,32 --steps 20
"""


class Grid:
    def __init__(self, mesh):
        self._mesh = mesh
        self.stages, self.replicas = mesh.size("pipeline"), mesh.size("data")
        self.stage, self.replica = mesh.coords.pipeline, mesh.coords.data
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.stage_comm = mesh.comm("data")
        self.pipe_comm = mesh.comm("pipeline")
        self.tensors, self.tensor = mesh.size("tensor"), mesh.coords.tensor

    def world_rank(self, stage, replica=None, tensor=None):
        """The world rank of (stage, replica, tensor rank), this rank's replica and tensor rank by default."""
        return self._mesh.rank_of(pipeline=stage, data=self.replica if replica is None else replica,
                                  tensor=self.tensor if tensor is None else tensor)
