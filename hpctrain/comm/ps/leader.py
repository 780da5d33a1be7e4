"""Sync rounds across servers: ps 0 (the leader) sends each round's decision
(its version, the stop version, the preempted flag and the members) to the
other servers, which apply a round only once its decision is here (round.py
decides, server.py carries out; this is the wire between them).

    mpirun -n 4 python -m hpctrain.comm.ps      # 2 ps: the leader's decisions reach ps 1

One persistent request per follower on the leader, one receive on each
follower; a decision waits for the previous one to have left.
"""
import numpy as np
from mpi4py import MPI

from .protocol import F_PREEMPTED, H_FLAGS, H_OP, H_STOP, H_VERSION, HEADER, OP_ROUND, TAG_ROUND, ProtocolError


class RoundLink:
    """The leader's side (announce) or a follower's (request, read, listen)."""

    def __init__(self, comm, servers, num_workers, waits, watchdog):
        self.servers, self.waits, self.watchdog = list(servers), waits, watchdog
        self.leader = comm.Get_rank() == self.servers[0]
        self.buf = np.zeros(HEADER + num_workers, np.int64)
        self.sending = False
        if self.leader:
            self.sends = [comm.Send_init(self.buf, s, TAG_ROUND) for s in self.servers[1:]]
            self.request = None
        else:
            self.sends = []
            self.request = comm.Recv_init(self.buf, self.servers[0], TAG_ROUND)

    def listen(self):
        """A follower: ready for the next decision."""
        if self.request is not None:
            self.request.Start()

    def announce(self, version, stop_version, preempted, members):
        """The leader: round `version` is these members'."""
        self.finish()
        buf = self.buf
        buf[:] = 0
        buf[H_OP], buf[H_VERSION], buf[H_STOP] = OP_ROUND, version, stop_version
        buf[H_FLAGS] = F_PREEMPTED if preempted else 0
        buf[HEADER + np.asarray(members, np.int64)] = 1
        MPI.Prequest.Startall(self.sends)
        self.sending = True

    def read(self, rank):
        """A follower, its request complete: (version, stop version, preempted, members)."""
        buf = self.buf
        if int(buf[H_OP]) != OP_ROUND:
            raise ProtocolError(f"ps rank {rank}: round decision for version {int(buf[H_VERSION])} "
                                f"with op {int(buf[H_OP])}")
        return int(buf[H_VERSION]), int(buf[H_STOP]), bool(buf[H_FLAGS] & F_PREEMPTED), np.flatnonzero(buf[HEADER:])

    def finish(self):
        """The last decision has left (the leader)."""
        if self.sending:
            with self.watchdog.waiting("round decision to servers", peer=self.servers[1:]):
                self.waits.all(self.sends)
            self.sending = False

    def free(self):
        if self.request is not None:
            self.request.Cancel()
            self.request.Wait()
            self.request.Free()
        for req in self.sends:
            req.Free()
