"""Run hpctrain.mnist with one rank killed (SIGKILL, no goodbye) right after
it finished a given step, or inside the first checkpoint write, the final
evaluation after it or a recovery from another rank's loss: a fault injected from the tests, for --on-failure shrink
(run/survival.py).

    FAULT_KILL=2:35 PYTHONPATH=tests/faults mpirun --with-ft ulfm -n 4 python -m killed_rank --on-failure shrink ...

Environment: FAULT_KILL=R:STEP[:WHEN][,...]  rank R (the launcher's numbering) kills itself after step
STEP; WHEN checkpoint: instead, once past step STEP, when it has written its file of a checkpoint (the
others wait in the write's gather; the chief has made the temporary folder); WHEN evaluation: when it
enters its part of the final evaluation (the others wait in its allreduce); WHEN recovery: when, a
survivor of another rank's loss, it comes to gather the commit's shards (the others wait in that gather).
"""
import os
import signal
import sys

from hpctrain.base import launcher


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _patch():
    kills = {int(kill.split(":")[0]): (kill.split(":") + ["step"])[1:3] for kill in os.environ["FAULT_KILL"].split(",")}
    if (launcher.launcher_env()[0] or 0) not in kills:
        return
    step, during = kills[launcher.launcher_env()[0] or 0]
    step = int(step)
    from hpctrain.loops import frame
    ended = frame.Frame.step_ended
    armed = []

    def step_ended(self, at, *args, **kwargs):
        if at == step and during == "step":
            _die()
        if at >= step:
            armed.append(at)
        return ended(self, at, *args, **kwargs)
    frame.Frame.step_ended = step_ended
    if during == "checkpoint":
        from hpctrain.checkpoints import named
        written = named._written

        def _written(*args, **kwargs):
            done = written(*args, **kwargs)
            if armed:
                _die()
            return done
        named._written = _written
    elif during == "evaluation":
        from hpctrain.report import evaluated

        def evaluate_parts(self, inputs):
            _die()
        evaluated.WholeModel.evaluate_parts = evaluate_parts
    elif during == "recovery":
        from hpctrain.run import survival

        def _whole(self, *args, **kwargs):
            _die()
        survival.Survival._whole = _whole
    elif during != "step":
        raise SystemExit(f"FAULT_KILL: {during}: expected step, checkpoint, evaluation or recovery")


if __name__ == "__main__":
    _patch()
    from hpctrain.train import main
    sys.exit(main(sys.argv[1:], prog="python -m hpctrain.mnist"))
