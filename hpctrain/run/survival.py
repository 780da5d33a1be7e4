"""A run that outlives a lost rank (`--on-failure shrink`, issue 58): every
`--commit-every K` steps each rank holds, in memory, what a resume needs (the
whole named tensors of its parts, the optimizer's step, the data position,
the samples and the clock: a commit); when a peer dies, MPI's ULFM
(comm/ulfm.py) makes the survivors' communicator and the run is built again
on it exactly as a resume at N-1 ranks from that commit would be: the same
start-up (run/startup.start on the smaller communicator), the same restore
of every part's box (checkpoints/resume.Checkpoints.restore reads the
commit as it reads a checkpoint folder), the same data windows.

Plain data parallelism (ring, --zero 0) for now: every replica holds every
tensor whole, so any survivor's commit is the whole state.

    mpirun --with-ft ulfm -n 4 python -m hpctrain.mnist --on-failure shrink --zero 0 --commit-every 10
"""
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..comm import ulfm
from ..state.parts import box_slices


@dataclass(frozen=True)
class Commit:
    """What a resume needs, held in this process (host copies)."""
    step: int
    optimizer_t: int
    samples: int          # training samples taken up to `step`
    clock: tuple          # (elapsed, compute, communication seconds, segments), as a checkpoint records it
    position: tuple       # (epoch, pos) where the data goes on (every replica's is the same in ring mode)
    tensors: dict         # name -> the whole tensor

    def read(self, name, box):
        """state/consumers.restore's read: the box of a whole tensor."""
        return self.tensors[name][box_slices(box)]


@dataclass
class Survival:
    """One process's side of --on-failure shrink, kept across rebuilds: the
    commits (the last two: a failure inside a step may leave survivors one
    commit apart, and they go on from the older), the recoveries so far, and
    the communicator the run stands on now."""
    every: int
    comm: object = None
    commits: list = field(default_factory=list)
    recoveries: list = field(default_factory=list)
    pending: Commit = None    # the commit the rebuilt run resumes from (read once by its checkpoints)
    done: int = 0             # the last step this rank finished
    ended: bool = False       # past the last step: in the final evaluation, checkpoint or --save
    _said: tuple = None       # (when the last recovery began, its line)

    def stepped(self, step):
        self.done = step

    def ending(self):
        self.ended = True

    def due(self, step):
        return self.every and step % self.every == 0

    def commit(self, step, optimizer_t, samples, clock, position, parts):
        """After step `step`: hold copies of this rank's parts (every part
        whole in plain data parallelism)."""
        from ..base import device
        # Into the older commit's arrays: fresh ones cost their pages' first
        # touch every time (8 MB: 31 ms a commit against 7 ms reused, on a loaded machine here)
        tensors = self.commits[0].tensors if len(self.commits) == 2 else {}
        for p in parts:
            values = device.to_host(p.view)
            if p.name in tensors and tensors[p.name].shape == values.shape:
                np.copyto(tensors[p.name], values)
            else:
                tensors[p.name] = np.array(values, copy=True)
        self.commits = self.commits[-1:] + [Commit(step, int(optimizer_t), int(samples),
                                                   (float(clock["elapsed_s"]), float(clock["compute_s_total"]),
                                                    float(clock["comm_s_total"]), int(clock["segments"])),
                                                   tuple(int(v) for v in position), tensors)]

    def take_pending(self):
        pending, self.pending = self.pending, None
        return pending

    def recover(self, world, rebuild):
        """After a lost peer, on this survivor: shrink, agree on the
        commit every survivor holds, rebuild the run on the survivors
        (rebuild(comm) -> start-up's (world, plan, inputs)). The line, and the
        record's entry, on the new chief."""
        t0 = time.perf_counter()
        old = world.comm
        roles = world.watchdog.roles
        before = old.Get_size()
        shrunk = ulfm.shrink(old)
        comm = self.comm = shrunk.comm
        # The failed world's communicators, revoked, are of no more use: freed (MPI_Comm_free
        # is local, and completes on a revoked communicator under ULFM); the launcher's
        # world is not ours to free.
        if world.mesh is not None:
            world.mesh.free()
        if old != MPI.COMM_WORLD:
            old.Free()
        mine = np.array([self.commits[-1].step if self.commits else -1, self.done + 1, self.ended], np.int64)
        with world.waiting("agreeing on the commit after a lost rank", peer=None):
            comm.Allreduce(MPI.IN_PLACE, mine[:1], op=MPI.MIN)
            comm.Allreduce(MPI.IN_PLACE, mine[1:], op=MPI.MAX)
        self.ended = False   # (the rebuilt run reaches its end again)
        step = int(mine[0])
        held = [c for c in self.commits if c.step == step]
        if not held:
            from ..base.errors import HpctrainError
            raise HpctrainError(f"rank {', '.join(map(str, shrunk.lost_world))} failed before the first in-memory "
                                f"commit (--commit-every {self.every}): nothing to go on from",
                                exit_code=75, collective=True, report=comm.Get_rank() == 0)
        self.commits, self.pending = held, held[0]
        # the launcher's rank numbers (what the job's other lines say), the node each was on
        # (a whole node lost shows as its ranks together), the roles they had
        hosts = world.cluster.hosts
        who = ", ".join(f"rank {w} (node {hosts[r]}" + (f", {roles(r)})" if roles else ")")
                        for r, w in zip(shrunk.lost, shrunk.lost_world))
        world.watchdog.roll_call_on(comm)
        # in a step: the step; past the last one (a survivor in the run's end): after the last step
        failed = int(mine[1]) - int(mine[2])
        when = f"after step {failed}, in the run's end (final evaluation and writes)" if mine[2] else f"at step {failed}"
        self._said = (t0, f"hpctrain: {who} failed {when}; going on with {comm.Get_size()} ranks from the "
                          f"commit of step {step}, {failed - step} steps lost")
        self.recoveries.append({"step": failed, "commit_step": step, "lost": list(shrunk.lost_world),
                                "ranks_before": before, "ranks_after": comm.Get_size(), "seconds": None})
        return rebuild(comm)

    def restored(self, say):
        """The rebuilt run holds the commit's state (loops/frame.Frame.resumed):
        the recovery's seconds, from the failure's error to here, and its
        line (say: the new chief's)."""
        t0, line = self._said
        seconds = time.perf_counter() - t0
        self.recoveries[-1]["seconds"] = round(seconds, 3)
        say(f"{line}, {seconds:.1f} s")


def revoke_on_failure(comm):
    """Every communicator made from comm from now on (they inherit its error
    handler) is revoked by the rank that sees a peer's failure in it, so the
    survivors waiting in it for a live peer wake too (ERR_REVOKED) instead of
    waiting for a rank that went to recover; the call then raises as usual."""
    def handler(c, code):
        if MPI.Get_error_class(code) in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
            try:
                c.Revoke()
            except MPI.Exception:
                pass
    comm.Set_errhandler(MPI.Comm.Create_errhandler(handler))
