"""The MPI world one run lives in, as run/startup.py finds it: the
communicator and the cluster's roles, the mesh of process groups (ring
and pipeline modes: run/mesh.py), the chief, the watchdog every wait
runs under, the stop signal, the array module and device, and the clock.
What the flags and data decide is the plan (run/plan.py); this is what the
ranks are.

    mpirun -n 2 python -m hpctrain.mnist --steps 20    # every rank makes one World at start-up
"""
from dataclasses import dataclass

from mpi4py import MPI

from ..comm.agree import agreed


@dataclass(frozen=True)
class World:
    comm: object            # MPI.COMM_WORLD
    cluster: object         # run/cluster.Cluster: roles, communicators, nodes
    watchdog: object        # comm/deadline.Watchdog
    stop: object            # run/stop_signal.StopSignal
    xp: object              # numpy or cupy: where the model computes
    device_name: str
    server_xp: object       # ps mode: where servers keep their slice
    thread_multiple: bool   # MPI gives MPI_THREAD_MULTIPLE (a communication thread may call it)
    waits: object           # comm/waits.Waits: how this rank waits (naps where ranks outnumber cores)
    t_start: float          # perf_counter at start-up, after the checks that need no data
    mesh: object = None     # run/mesh.Mesh: ring and pipeline modes' process groups (ps mode: none)
    survival: object = None  # run/survival.Survival under --on-failure shrink: the in-memory commits, the recoveries

    @property
    def chief(self):
        """This rank writes the metrics, checkpoints and --save (ring: rank 0; ps: worker 0)."""
        return self.cluster.is_chief

    def agreed(self, comm, fn, *args, what=None):
        """comm/agree.agreed under this world's watchdog."""
        return agreed(comm, fn, *args, watchdog=self.watchdog, what=what)

    def say(self, text):
        """A line on standard output from the chief; the other ranks stay quiet."""
        if self.chief:
            print(text, flush=True)

    def waiting(self, what, peer=None, own=False):
        return self.watchdog.waiting(what, peer=peer, own=own)

    def chief_in(self, comm):
        """The chief's rank in comm (a communicator that contains it)."""
        world, group = self.comm.Get_group(), comm.Get_group()
        try:
            return MPI.Group.Translate_ranks(world, [self.cluster.chief_rank], group)[0]
        finally:
            world.Free()
            group.Free()
