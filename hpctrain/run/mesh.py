"""The mesh of process groups: the ranks of a ring or pipeline run laid out
on named axes, pipeline x data x tensor (DeepSpeed's
PipeModelDataParallelTopology), built once at start-up (run/startup.py)
from the world communicator and the plan (P stages; T tensor ranks,
--tensor-parallel; R = size / (P T) replicas). It hands out
each axis's communicator (made once here, freed once by `free`) and any
rank's coordinates; no other module computes rank arithmetic. Takes a
communicator; never imports MPI itself.

Rank order: a rank's number is its coordinates read as a number with the
tensor axis fastest, then data, then pipeline:

    rank = (pipeline * R + data) * T + tensor

So a tensor group (the T ranks that split one layer, and exchange
activations inside every layer) is T consecutive ranks, inside one node on
a launcher that fills nodes in rank order; the replicas of one stage come
next (their gradient allreduce, every step, stays near); the stages lie
across nodes, where only one micro-batch's activations cross (Megatron's
and DeepSpeed's rule). With T = 1 this is the pipeline's placement of
before the mesh: stage s is world ranks [s R, (s + 1) R).

- `comm(axis)`: the ranks that differ from this one along `axis` alone, in
  the order of their coordinate there (its rank there is that coordinate).
  "data": the replicas a gradient is averaged over (ring mode's allreduce,
  a stage's replicas); "pipeline": one replica's stages, activations travel
  there; "tensor": a layer's slices.
- `coordinates(rank)`, `rank_of(...)`, `describe(rank)`: where a rank sits,
  the rank at given coordinates, and its place in words for the
  watchdog's lines ("pipeline 1, data 1, tensor 0").

The ring loop (loops/ring.py) averages over `comm("data")`; the pipeline's
Grid (pipeline/grid.py) is a view of the mesh in stage and replica words.
ps mode has no mesh: its servers hold parameter slices, not coordinates,
and keep their roles (run/cluster.py: /job:ps/task:k). run/cluster.py's
`worker_comm` stays the communicator of the workers as roles (every rank of
a ring or pipeline run, the mesh's ranks in the same order): evaluation,
checkpoints and the run's agreements go there in every mode.

Layers that need a collective (a tensor-parallel layer's allreduce,
reduce-scatter or allgather) get it through their TensorGroup's handle,
made by the loop from `comm("tensor")` (comm/tensor_group.py), so nn/
never imports MPI.

    mpirun -n 4 python -m hpctrain.run.mesh --pipeline 2    # prints each rank's coordinates
"""
from collections import namedtuple

AXES = ("pipeline", "data", "tensor")   # slowest to fastest in the rank order

Coordinates = namedtuple("Coordinates", AXES)


class Mesh:
    """The ranks of comm as pipeline x data x tensor; collective over comm
    (one Split per axis). `pipeline` and `tensor` must divide the size (the
    plan's checks refuse a layout that does not, before the mesh is made)."""

    def __init__(self, comm, pipeline=1, tensor=1):
        size = comm.Get_size()
        if pipeline < 1 or tensor < 1 or size % (pipeline * tensor):
            raise ValueError(f"a mesh of {pipeline} stages x {tensor} tensor slices does not divide {size} ranks")
        self.shape = Coordinates(pipeline, size // (pipeline * tensor), tensor)
        self.rank = comm.Get_rank()
        self.coords = self.coordinates(self.rank)
        self._comms = {axis: comm.Split(self._line_of(axis), getattr(self.coords, axis)) for axis in AXES}

    def size(self, axis):
        """How many ranks lie along `axis`."""
        return getattr(self.shape, axis)

    def coordinates(self, rank):
        """A rank's (pipeline, data, tensor)."""
        rest, tensor = divmod(rank, self.shape.tensor)
        pipeline, data = divmod(rest, self.shape.data)
        return Coordinates(pipeline, data, tensor)

    def rank_of(self, **coords):
        """The rank at the given coordinates; an axis not given: this rank's."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"no axis {', '.join(sorted(unknown))} on the mesh (axes: {', '.join(AXES)})")
        at = self.coords._replace(**coords)
        return (at.pipeline * self.shape.data + at.data) * self.shape.tensor + at.tensor

    def describe(self, rank):
        """A rank's place in words, for the watchdog's lines."""
        return ", ".join(f"{axis} {value}" for axis, value in zip(AXES, self.coordinates(rank)))

    def comm(self, axis):
        """The communicator along `axis` (this rank's rank there: its coordinate)."""
        return self._comms[axis]

    def free(self):
        """Frees the axes' communicators, once: a second call has nothing left to free."""
        comms, self._comms = self._comms, {}
        for comm in comms.values():
            comm.Free()

    def _line_of(self, axis):
        """The Split colour of this rank's line along `axis`: the rank where
        that line meets coordinate 0 there, the same for the whole line."""
        return self.rank_of(**{axis: 0})


if __name__ == "__main__":
    from mpi4py import MPI

    from ..flags.arguments import Parser
    p = Parser(prog="python -m hpctrain.run.mesh")
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--tensor", type=int, default=1)
    a = p.parse_args()
    mesh = Mesh(MPI.COMM_WORLD, a.pipeline, a.tensor)
    print(f"rank {mesh.rank}: {mesh.describe(mesh.rank)}", flush=True)
    mesh.free()
