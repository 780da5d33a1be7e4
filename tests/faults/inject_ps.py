"""Run hpctrain.mnist (--mode ps) with faults injected from the tests, not
from production code: a slow worker, a server that stops answering, a stop
signal at a given step, pid files for tests that stop a rank from outside,
and a hold of the chief until a stop signal reached it.

    FAULT_SLOW_WORKER=1:0.1 mpirun -n 3 python tests/faults/inject_ps.py --mode ps --steps 15

Environment (each item `index:value`, several separated by commas):
  FAULT_SLOW_WORKER=i:s[,j:s]  worker i sleeps s seconds in every step, after
                               its forward/backward pass (a straggler)
  FAULT_HANG_PS=k:v            ps task k stops answering once its version reaches v
  FAULT_SIGNAL=i:n             worker i sends itself SIGUSR1 in its n-th step,
                               after its forward/backward pass, before its push
  FAULT_STOP_WORKER=i:n        worker i stops itself (SIGSTOP) in its n-th step, its push
                               started and its reply posted, before it waits for the reply:
                               messages to and from it stay half-way until SIGCONT
  FAULT_PID_DIR=DIR            every rank writes its pid to DIR/rank-<rank>.pid
  PROBE_PROGRESS=DIR           every worker writes its local step count to
                               DIR/worker-<i>.steps every 10 steps
  HELD_AFTER_STEP=S            after writing its first checkpoint of a step past S,
                               the chief waits (up to 30 s) for a stop signal, then
                               goes on (tests/held_for_signals.py's hold, on ps's
                               path: Checkpoints.save_written; tests/ on PYTHONPATH)
  PROBE_CUTS=FILE              the chief appends each checkpoint cut's server
                               versions and optimizer steps to FILE (JSON lines)
"""
import json
import os
import signal
import sys
import time

# Nothing that loads numpy or MPI here: hpctrain.mnist configures the process
# (BLAS threads, MPI progress) first; the faults go in right after that.
from hpctrain.run import cluster
from hpctrain import train as entry


def setting(name, index):
    """The value for `index` in a variable like "1:0.2,3:0.5", or None."""
    for item in os.environ.get(name, "").split(","):
        if ":" in item:
            key, value = item.split(":", 1)
            if int(key) == index:
                return float(value)
    return None


def inject_worker_faults():
    """Patched in every process; active once a Client says which worker this is."""
    from hpctrain.comm.ps import Client
    from hpctrain.nn.sequential import Sequential
    worker = {}
    client_init, forward_backward = Client.__init__, Sequential.forward_backward
    progress = os.environ.get("PROBE_PROGRESS")

    def init(self, *args, **kwargs):
        client_init(self, *args, **kwargs)
        worker.update(index=self.worker, steps=0,
                      slow=setting("FAULT_SLOW_WORKER", self.worker),
                      signal_at=setting("FAULT_SIGNAL", self.worker),
                      stop_at=setting("FAULT_STOP_WORKER", self.worker))

    def step(self, *args, **kwargs):
        loss = forward_backward(self, *args, **kwargs)
        if worker:
            if worker["slow"]:
                time.sleep(worker["slow"])
            worker["steps"] += 1
            if progress and worker["steps"] % 10 == 0:
                # written aside and renamed: a reader never sees the file truncated and empty
                path = os.path.join(progress, f"worker-{worker['index']}.steps")
                with open(path + ".part", "w") as f:
                    f.write(str(worker["steps"]))
                os.replace(path + ".part", path)
            if worker["signal_at"] == worker["steps"]:
                signal.raise_signal(signal.SIGUSR1)
        return loss

    waiting = Client.waiting

    def waiting_or_stop(self, what, peer=None):
        if worker and worker["stop_at"] == worker["steps"] and what.startswith("push"):
            worker["stop_at"] = None
            os.kill(os.getpid(), signal.SIGSTOP)
        return waiting(self, what, peer)

    Client.__init__, Sequential.forward_backward, Client.waiting = init, step, waiting_or_stop


def inject_server_hang():
    """ps task k hangs at the first reply once its version reached v (right
    after the update that reached it, before any reply leaves)."""
    from hpctrain.comm.ps import Server
    reply = Server.reply

    def patched(self, w):
        hang_at = setting("FAULT_HANG_PS", self.servers.index(self.rank))
        if hang_at is not None and self.round.version >= hang_at:
            print(f"fault: ps task {self.servers.index(self.rank)} (rank {self.rank}) stops answering "
                  f"at version {self.round.version}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        reply(self, w)

    Server.reply = patched


def probe_cuts(path):
    """Record what every snapshot and final state looked like, server by server."""
    from hpctrain.comm.ps import Client
    snapshot, final = Client.snapshot, Client.final

    def record(cut, kind):
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "versions": cut.versions, "ts": cut.ts}) + "\n")

    def snapshot_recorded(self, *args, **kwargs):
        cut = snapshot(self, *args, **kwargs)
        record(cut, "snapshot")
        return cut

    def final_recorded(self, folder=None):
        stats, cut = final(self, folder)
        if cut is not None:
            record(cut, "final")
        return stats, cut

    Client.snapshot, Client.final = snapshot_recorded, final_recorded


def main():
    rank = cluster.launcher_env()[0]
    if os.environ.get("FAULT_PID_DIR"):
        with open(os.path.join(os.environ["FAULT_PID_DIR"], f"rank-{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    configure = cluster.configure_process

    def configure_then_inject(*args, **kwargs):
        note = configure(*args, **kwargs)
        inject_worker_faults()
        if os.environ.get("FAULT_HANG_PS"):
            inject_server_hang()
        if os.environ.get("HELD_AFTER_STEP"):
            from hpctrain.checkpoints.resume import Checkpoints
            from held_for_signals import hold_after_checkpoints   # tests/ on PYTHONPATH too
            hold_after_checkpoints(int(os.environ["HELD_AFTER_STEP"]), Checkpoints, "save_written")
        if os.environ.get("PROBE_CUTS"):
            probe_cuts(os.environ["PROBE_CUTS"])
        return note

    cluster.configure_process = configure_then_inject
    sys.exit(entry.main())


if __name__ == "__main__":
    main()
