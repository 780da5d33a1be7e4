"""A run that outlives a lost rank (`--on-failure shrink`, issue 58): every
`--commit-every K` steps each rank holds, in memory, what a resume needs (the
whole named tensors of its parts, the optimizer's step, the data position,
the samples and the clock: a commit); when a peer dies, MPI's ULFM
(comm/ulfm.py) makes the survivors' communicator and the run is built again
on it exactly as a resume at N-1 ranks from that commit would be: the same
start-up (run/startup.start on the smaller communicator), the same restore
of every part's box (checkpoints/resume.Checkpoints.restore reads the
commit as it reads a checkpoint folder), the same data windows.

Data and tensor parallelism (ring) for now. Without ZeRO every replica
holds every tensor whole, so any survivor's commit is the whole state; with
--zero 1|2|3 a replica alone holds its shards, so each commit also keeps a
copy of the next rank's (sent to the previous rank: one Sendrecv), and a
recovery puts every shard together from its owner or that copy. A rank and
its neighbour lost: a shard is held by no survivor, one line, exit 75.
With --tensor-parallel T a rank's commit is its slice (a box of each whole
tensor), held alike by every replica of its tensor position: a recovery
takes each slice from one survivor of that position, and the run goes on
on the largest multiple of T survivors; a survivor left over leaves (its
part in the gather done; docs/faults.md says why). A position with no
survivor, or fewer survivors than T: one line, exit 75.

When to commit (`--commit-every auto`, the default): a time budget, not a
step count. Each rank times its commits and the steps between them and
proposes the next interval so that a commit costs at most BUDGET of the
run's time (its last commit's seconds / (BUDGET x its mean step seconds)
since the last commit), between 1 and LONGEST steps; the ranks take the
largest proposal, agreed in one nonblocking MAX started by the commit and
read at the next step (never a blocking round a step). A start (the run's,
or a rebuilt one's) has nothing timed yet: its next commit is FIRST steps
on, so a loss early loses little. `--commit-every K`: every K steps.

    mpirun --with-ft ulfm -n 4 python -m hpctrain.mnist --on-failure shrink --commit-every 10
"""
import json
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
from mpi4py import MPI

from ..comm import ulfm
from ..state.parts import box_shape, box_slices
from .mesh import AXES


TAG = 32100   # a commit's shards to the previous rank (the neighbour's copy)
BUDGET = 0.02   # --commit-every auto: the commits' share of the run's time
FIRST = 10      # auto: steps from a start to the first commit timed (before any step is)
LONGEST = 200   # auto: the most steps between commits (what a loss can cost)


@dataclass(frozen=True)
class Commit:
    """What a resume needs, held in this process (host copies): `pieces`
    [(name, box, values, alone)], its parts' boxes (alone: a ZeRO shard only
    this replica holds; the rest every replica holds alike) and, with ZeRO,
    `neighbour` [(name, box, values)], the next rank's shards (rank r + 1 mod
    size of the communicator the commit was made on: `rank`, `size`).
    `tensors`, the whole tensors read back, is put together at a recovery."""
    step: int
    optimizer_t: int
    samples: int          # training samples taken up to `step`
    clock: tuple          # (elapsed, compute, communication seconds, segments), as a checkpoint records it
    position: tuple       # (epoch, pos) where the data goes on (every replica's is the same in ring mode)
    pieces: list
    neighbour: list = None
    rank: int = 0
    size: int = 1
    slice: int = 0        # --tensor-parallel: this rank's tensor position at the commit, of `slices`
    slices: int = 1
    packed: object = None     # the uint8 buffer this rank's shards live in (what goes to the neighbour)
    received: object = None   # the uint8 buffer the neighbour's live in
    tensors: dict = None

    def read(self, name, box):
        """state/consumers.restore's read: the box of a whole tensor."""
        return self.tensors[name][box_slices(box)]


def _packed(described, buffer=None):
    """Arrays [(name, box, values)] laid back to back in one uint8 buffer
    (`buffer` reused where it is the size), as described [(name, box, dtype)]."""
    sizes = [int(np.prod(box_shape(box), dtype=np.int64)) * np.dtype(dtype).itemsize for _, box, dtype in described]
    total = int(sum(sizes))
    if buffer is None or buffer.size != total:
        buffer = np.empty(total, np.uint8)
    out, at = [], 0
    for (name, box, dtype), n in zip(described, sizes):
        out.append((name, box, buffer[at:at + n].view(np.dtype(dtype)).reshape(box_shape(box))))
        at += n
    return buffer, out


def _described(pieces):
    return [(name, tuple(map(tuple, box)), np.dtype(values.dtype).str) for name, box, values, *_ in pieces]


def _joined(ranks):
    ranks = [str(r) for r in ranks]
    return ranks[0] if len(ranks) == 1 else f"{', '.join(ranks[:-1])} and {ranks[-1]}"


@dataclass
class Survival:
    """One process's side of --on-failure shrink, kept across rebuilds: the
    commits (the last two: a failure inside a step may leave survivors one
    commit apart, and they go on from the older), the recoveries so far, and
    the communicator the run stands on now. every: K, or "auto" (the
    module's docstring)."""
    every: object
    comm: object = None
    commits: list = field(default_factory=list)
    recoveries: list = field(default_factory=list)
    pending: Commit = None    # the commit the rebuilt run resumes from (read once by its checkpoints)
    done: int = 0             # the last step this rank finished
    saved: int = None         # the step of the newest checkpoint on disk (the exit-75 line names it)
    ended: bool = False       # past the last step: in the final evaluation, checkpoint or --save
    _said: tuple = None       # (when the last recovery began, its line)
    _link: tuple = None       # (communicator, the neighbour's shards described): exchanged once a communicator
    made: int = 0             # commits made by this rank, and their seconds (the final record's "commits")
    made_s: float = 0.0
    _timed: tuple = None      # auto: (when the last commit ended, its step); None at a start
    _next: int = None         # auto: the step of the next commit, as agreed
    _agreed: int = None       # auto: the last interval agreed (steps)
    _agreeing: tuple = None   # auto: (the MAX of the proposals under way, its buffer, the commit's step, waiting)
    clock: object = field(default=time.perf_counter, repr=False)   # what commits and steps are timed by

    def stepped(self, step, saved=None):
        self.done, self.saved = step, saved

    def ending(self):
        self.ended = True
        if self._agreeing is not None:   # the last commit's MAX, left to finish (every rank started it)
            request, _, _, waiting = self._agreeing
            with waiting("the next commit's step agreed", None):
                request.Wait()
            self._agreeing = None

    def due(self, step):
        """A commit after step `step` (the same answer on every rank)."""
        if self.every != "auto":
            return step % self.every == 0
        if self._agreeing is not None:   # started by the last commit: every rank is in it by now
            request, proposal, at, waiting = self._agreeing
            with waiting("the next commit's step agreed", None):
                request.Wait()
            self._agreeing, self._agreed = None, int(proposal[0])
            self._next = at + self._agreed
        return step >= self._next

    def totals(self):
        """The final record's "commits": this rank's count and mean cost, the interval."""
        return {"count": self.made, "mean_ms": round(1000 * self.made_s / max(self.made, 1), 3),
                "every": self.every, **({"last_agreed": self._agreed} if self.every == "auto" else {})}

    def _schedule(self, step, t0, t1, comm, waiting):
        """auto, after the commit of `step` (t0 to t1): propose the next one's
        step to the others (a MAX, nonblocking: due() reads it)."""
        last, self._timed = self._timed, (t1, step)
        if last is None or step <= last[1]:   # a start: nothing timed yet
            self._next, self._agreeing = step + FIRST, None
            return
        per_step = max(t0 - last[0], 1e-9) / (step - last[1])
        proposal = np.array([min(LONGEST, max(1, math.ceil((t1 - t0) / (BUDGET * per_step))))], np.int64)
        self._agreeing = (comm.Iallreduce(MPI.IN_PLACE, proposal, op=MPI.MAX), proposal, step, waiting)

    def commit(self, step, optimizer_t, samples, clock, position, parts, alone=None, comm=None, waiting=None,
               tensor=(0, 1)):
        """After step `step`: hold copies of this rank's parts. alone: None
        where every replica holds every part (plain data parallelism), else
        the parts this replica alone holds (ZeRO's shards), which also go to
        the previous rank of comm, which hands over the next one's: one
        Sendrecv (waiting: run/world.World.waiting). tensor: this rank's
        tensor position and the tensor ranks (--tensor-parallel). Timed;
        under auto, the next commit's step proposed to every rank of the
        run (self.comm: comm is the data axis alone with --tensor-parallel)."""
        from ..base import device
        t0 = self.clock()
        sharded = alone is not None
        alone = {id(p) for p in alone or ()}
        # Into the older commit's arrays: fresh ones cost their pages' first
        # touch every time (8 MB: 31 ms a commit against 7 ms reused, on a loaded machine here)
        old = self.commits[0] if len(self.commits) == 2 else None
        rank, size = (comm.Get_rank(), comm.Get_size()) if sharded else (0, 1)
        if old is not None and (old.rank, old.size) != (rank, size):
            old = None
        # the older commit is gone while its arrays are written: a failure in the exchange leaves the last one
        self.commits = self.commits[-1:]
        shared = {(n, b): v for n, b, v, a in old.pieces if not a} if old is not None else {}
        pieces = []
        for p in parts:
            if id(p) in alone:
                continue
            values = device.to_host(p.view)
            kept = shared.get((p.name, p.box))
            if kept is not None and kept.shape == values.shape and kept.dtype == values.dtype:
                np.copyto(kept, values)
            else:
                kept = np.array(values, copy=True)
            pieces.append((p.name, p.box, kept, False))
        packed = received = neighbour = None
        if sharded:
            mine = [p for p in parts if id(p) in alone]
            packed, views = _packed([(p.name, p.box, np.dtype(p.view.dtype).str) for p in mine],
                                    old.packed if old is not None else None)
            for p, (name, box, view) in zip(mine, views):
                np.copyto(view, device.to_host(p.view))
                pieces.append((name, box, view, True))
            received, neighbour = self._exchange(comm, waiting, _described(views), packed,
                                                 old.received if old is not None else None)
        self.commits = self.commits[-1:] + [Commit(step, int(optimizer_t), int(samples),
                                                   (float(clock["elapsed_s"]), float(clock["compute_s_total"]),
                                                    float(clock["comm_s_total"]), int(clock["segments"])),
                                                   tuple(int(v) for v in position), pieces, neighbour, rank, size,
                                                   int(tensor[0]), int(tensor[1]), packed, received)]
        t1 = self.clock()
        self.made, self.made_s = self.made + 1, self.made_s + t1 - t0
        if self.every == "auto":
            # (on every rank of the run: --tensor-parallel passes comm as the data axis alone)
            self._schedule(step, t0, t1, self.comm, waiting)

    def _exchange(self, comm, waiting, described, packed, received):
        """This rank's shards (`packed`) to the previous rank of comm, the next
        one's into `received` (reused): (received, [(name, box, values)]). What
        the shards are does not change while the layout stands: described
        to each other once a communicator."""
        rank, size = comm.Get_rank(), comm.Get_size()
        left, right = (rank - 1) % size, (rank + 1) % size
        if self._link is None or self._link[0] is not comm:
            raw = np.frombuffer(json.dumps(described).encode(), np.uint8)
            n = np.zeros(1, np.int64)
            with waiting("a commit's shards described to the neighbour", None):
                comm.Sendrecv(np.array([raw.size], np.int64), dest=left, sendtag=TAG, recvbuf=n, source=right,
                              recvtag=TAG)
                theirs = np.empty(int(n[0]), np.uint8)
                comm.Sendrecv(raw, dest=left, sendtag=TAG, recvbuf=theirs, source=right, recvtag=TAG)
            self._link = (comm, [(name, tuple(map(tuple, box)), dtype)
                                 for name, box, dtype in json.loads(bytes(theirs).decode())])
        received, views = _packed(self._link[1], received)
        with waiting("a commit's shards to the neighbour", None):
            comm.Sendrecv(packed, dest=left, sendtag=TAG, recvbuf=received, source=right, recvtag=TAG)
        return received, views

    def take_pending(self):
        pending, self.pending = self.pending, None
        return pending

    def recover(self, world, rebuild):
        """After a lost peer, on this survivor: shrink, agree on the
        commit every survivor holds, put its whole tensors together from
        the survivors' pieces, rebuild the run on the survivors
        (rebuild(comm) -> start-up's (world, plan, inputs)); with
        --tensor-parallel T on the first multiple of T of them, a survivor
        left over leaving here. The line, and the record's entry, on the new
        chief. Where some part of the commit is held by no survivor (a rank
        and its neighbour lost; a tensor position with no survivor) or the
        survivors are fewer than T: one line, exit 75. A survivor lost
        during all this (the agreement, the gather, the rebuild's start-up):
        shrink again and all again, one recovery of both."""
        t0 = time.perf_counter()
        # the interval's MAX under way is on the failed communicator: the rebuilt run starts again
        self._timed = self._agreeing = None
        old = world.comm
        before, ended = old.Get_size(), self.ended
        # the world's rank -> old's (the lines name nodes and roles by old's ranks)
        groups = old.Get_group(), MPI.COMM_WORLD.Get_group()
        in_old = dict(zip(MPI.Group.Translate_ranks(groups[0], list(range(before)), groups[1]), range(before)))
        for g in groups:
            g.Free()
        # every communicator a survivor may wait in, revoked, so the loss reaches each (a tensor
        # position's gradient ring holds no lost rank and would wait until --timeout)
        ulfm.revoke_all(([world.mesh.comm(axis) for axis in AXES] if world.mesh is not None else []) +
                        [world.cluster.worker_comm])
        # The failed world's communicators, revoked, are of no more use: freed (MPI_Comm_free
        # is local, and completes on a revoked communicator under ULFM); the launcher's
        # world is not ours to free.
        if world.mesh is not None:
            world.mesh.free()
        comm, lost = old, ()
        while True:
            shrunk = ulfm.shrink(comm)
            if comm != MPI.COMM_WORLD:
                comm.Free()
            comm = self.comm = shrunk.comm
            revoke_on_failure(comm)   # (what the rebuilt run makes of it inherits it, as from the world)
            lost = tuple(sorted(lost + shrunk.lost_world))
            try:
                return self._rebuilt(world, rebuild, comm, t0, before, ended, [(in_old[w], w) for w in lost])
            except MPI.Exception as exc:
                if not ulfm.peer_lost(exc):
                    raise
                comm = self.comm   # (a --tensor-parallel run's working part, where it split)

    def _rebuilt(self, world, rebuild, comm, t0, before, ended, lost):
        """recover() on the survivors' comm: lost [(rank before, the world's rank)]."""
        lost_world = [w for _, w in lost]
        mine = np.array([self.commits[-1].step if self.commits else -1, self.done + 1, ended], np.int64)
        with world.waiting("agreeing on the commit after a lost rank", peer=None):
            comm.Allreduce(MPI.IN_PLACE, mine[:1], op=MPI.MIN)
            comm.Allreduce(MPI.IN_PLACE, mine[1:], op=MPI.MAX)
        self.ended = False   # (the rebuilt run reaches its end again)
        # in a step: the step; past the last one (a survivor in the run's end): after the last step
        step, failed, ended = int(mine[0]), int(mine[1]) - int(mine[2]), bool(mine[2])
        held = [c for c in self.commits if c.step == step]
        who_lost = f"rank{'s' if len(lost_world) > 1 else ''} {_joined(lost_world)}"
        if not held:
            from ..base.errors import HpctrainError
            raise HpctrainError(f"{who_lost} failed before the first in-memory "
                                f"commit (--commit-every {self.every}): nothing to go on from",
                                exit_code=75, collective=True, report=comm.Get_rank() == 0)
        commit = held[0]
        survivors = comm.Get_size()
        if survivors < commit.slices:
            self._requeue(comm, f"{who_lost} failed at step {failed}: {survivors} "
                                f"survivor{'s' if survivors > 1 else ''} cannot hold --tensor-parallel "
                                f"{commit.slices}")
        self.commits, self.pending = held, self._whole(commit, comm, world.waiting, who_lost, failed)
        # --tensor-parallel T: the run goes on on the first multiple of T survivors
        kept = survivors - survivors % commit.slices
        left = []
        if kept < survivors:
            group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
            left = MPI.Group.Translate_ranks(group, list(range(kept, survivors)), world_group)
            group.Free()
            world_group.Free()
            # (it inherits comm's error handler, which revokes on a failure)
            working = comm.Split(0 if comm.Get_rank() < kept else MPI.UNDEFINED, comm.Get_rank())
            if working == MPI.COMM_NULL:   # left over: its part (the gather above) is done
                from ..comm.start import stop_survivors
                stop_survivors(world.watchdog, None)
            comm.Free()
            comm = self.comm = working
        # the launcher's rank numbers (what the job's other lines say), the node each was on
        # (a whole node lost shows as its ranks together), the roles they had
        hosts, roles = world.cluster.hosts, world.watchdog.roles
        who = ", ".join(f"rank {w} (node {hosts[r]}" + (f", {roles(r)})" if roles else ")") for r, w in lost)
        world.watchdog.roll_call_on(comm)
        built = rebuild(comm)
        when = f"after step {failed}, in the run's end (final evaluation and writes)" if ended else f"at step {failed}"
        spare = (f" (rank {_joined(left)} left the job: --tensor-parallel {commit.slices} runs on {kept} of the "
                 f"{survivors} survivors)") if left else ""
        self._said = (t0, f"hpctrain: {who} failed {when}; going on with {comm.Get_size()} ranks{spare} from the "
                          f"commit of step {step}, {failed - step} steps lost")
        self.recoveries.append({"step": failed, "commit_step": step, "lost": lost_world,
                                "ranks_before": before, "ranks_after": comm.Get_size(), "seconds": None,
                                **({"left": [int(r) for r in left]} if left else {})})
        return built

    def _requeue(self, comm, why):
        """The end of a run whose survivors cannot go on: `why`, the last
        checkpoint on disk as it is, exit 75 (the requeue path); collective."""
        from ..base.errors import HpctrainError
        kept = f"the last checkpoint (step {self.saved}) stands" if self.saved is not None else \
            "no checkpoint was written"
        raise HpctrainError(f"{why}; {kept}; exit 75 to requeue", exit_code=75, collective=True,
                            report=comm.Get_rank() == 0)

    def _whole(self, commit, comm, waiting, who_lost, failed):
        """The commit with its whole tensors, on every survivor of comm
        (collective): what every replica held, its own (with
        --tensor-parallel, each tensor position's slice from its first
        survivor); the shards, each from its owner if it survived, else from
        the previous rank's copy, gathered from every survivor (one
        Allgatherv of their descriptions, one of their values)."""
        split = commit.slices > 1
        tensors = {} if split else {name: values for name, box, values, alone in commit.pieces if not alone}
        if commit.neighbour is None and not split:   # plain data parallelism: every survivor holds every tensor
            return replace(commit, tensors=tensors)
        # where each survivor stood at the commit: its tensor position and its rank among that position's replicas
        alive = np.zeros((comm.Get_size(), 2), np.int64)
        with waiting("the survivors' ranks before the loss", None):
            comm.Allgather(np.array([commit.slice, commit.rank], np.int64), alive)
        alive = [(int(t), int(r)) for t, r in alive]
        empty = [t for t in range(commit.slices) if t not in {t for t, _ in alive}]
        if empty:
            self._requeue(comm, f"{who_lost} failed at step {failed}: tensor slice{'s' if len(empty) > 1 else ''} "
                                f"{_joined(empty)} of --tensor-parallel {commit.slices} "
                                f"{'are' if len(empty) > 1 else 'is'} held by no survivor")
        # a slice every replica of its position holds alike: sent by the first of them
        first = split and [t for t, _ in alive].index(commit.slice) == comm.Get_rank()
        given = [(n, b, v) for n, b, v, alone in commit.pieces if first and not alone]
        if commit.neighbour is not None:
            # each position's replicas lost (the same on every survivor: from `alive`)
            lost = {t: sorted(set(range(commit.size)) - {r for u, r in alive if u == t})
                    for t in range(commit.slices)}
            orphans = [(t, r) for t in range(commit.slices) for r in lost[t]
                       if (r - 1) % commit.size in lost[t]]   # r's copy was on r - 1
            if orphans:
                named = [f"{r}" + (f" of tensor slice {t}" if split else "") for t, r in orphans]
                self._requeue(comm, f"{who_lost} (neighbours) failed at step {failed}: "
                                    f"shard{'s' if len(orphans) > 1 else ''} {_joined(named)} "
                                    f"{'are' if len(orphans) > 1 else 'is'} held by no survivor")
            given += [(n, b, v) for n, b, v, alone in commit.pieces if alone]
            if (commit.rank + 1) % commit.size in lost[commit.slice]:
                given += commit.neighbour
        # every survivor's shards, described (JSON) and packed (raw bytes): no pickle
        raw = np.frombuffer(json.dumps(_described(given)).encode(), np.uint8)
        sizes = np.zeros((2, comm.Get_size()), np.int64)
        send = np.concatenate([np.ascontiguousarray(v).reshape(-1).view(np.uint8) for _, _, v in given]) \
            if given else np.empty(0, np.uint8)
        with waiting("the commit's shards to every survivor", None):
            comm.Allgather(np.array([raw.size], np.int64), sizes[0])
            comm.Allgather(np.array([send.size], np.int64), sizes[1])
            descriptions = np.empty(int(sizes[0].sum()), np.uint8)
            comm.Allgatherv(raw, [descriptions, sizes[0]])
            everything = np.empty(int(sizes[1].sum()), np.uint8)
            comm.Allgatherv(send, [everything, sizes[1]])
        pieces, at, bytes_at = [], 0, 0
        for n, m in zip(sizes[0], sizes[1]):
            listed = [(name, tuple(map(tuple, box)), dtype)
                      for name, box, dtype in json.loads(bytes(descriptions[at:at + n]).decode())]
            pieces += _packed(listed, everything[bytes_at:bytes_at + m])[1]
            at, bytes_at = at + n, bytes_at + m
        shapes = {}
        for name, box, values in pieces:
            stops = tuple(stop for _, stop in box)
            shapes[name] = (tuple(max(a, b) for a, b in zip(shapes[name][0], stops)) if name in shapes else stops,
                            values.dtype)
        for name, (shape, dtype) in shapes.items():
            tensors[name] = np.empty(shape, dtype)
        for name, box, values in pieces:
            tensors[name][box_slices(box)] = values
        return replace(commit, tensors=tensors)

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
