"""Run hpctrain.mnist with one rank killed (SIGKILL, no goodbye) right after
it finished a given step: a fault injected from the tests, for
--on-failure shrink (run/survival.py).

    FAULT_KILL=2:35 PYTHONPATH=tests/faults mpirun --with-ft ulfm -n 4 python -m killed_rank --on-failure shrink ...

Environment: FAULT_KILL=R:STEP[,R:STEP...]  rank R (the launcher's numbering) kills itself after step STEP.
"""
import os
import signal
import sys

from hpctrain.base import launcher


def _patch():
    kills = dict(tuple(int(v) for v in kill.split(":")) for kill in os.environ["FAULT_KILL"].split(","))
    step = kills.get(launcher.launcher_env()[0] or 0)
    if step is None:
        return
    from hpctrain.loops import frame
    ended = frame.Frame.step_ended

    def step_ended(self, at, *args, **kwargs):
        if at == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return ended(self, at, *args, **kwargs)
    frame.Frame.step_ended = step_ended


if __name__ == "__main__":
    _patch()
    from hpctrain.train import main
    sys.exit(main(sys.argv[1:], prog="python -m hpctrain.mnist"))
