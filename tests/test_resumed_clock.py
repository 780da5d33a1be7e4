"""A resumed run's clock and listing (issue 54, N7): `elapsed` and `time_s`
go on from the checkpoint's (they restarted at 0), the plot's "where the
time went" covers every run of it (it showed the last), and `hpctrain
checkpoint` lists the optimizer's own settings (an Adam run listed
`momentum 0.9`). The job that resumes: tests/test_config_file.py.

    python -m pytest -q tests/test_resumed_clock.py
"""
import time
from types import SimpleNamespace

from hpctrain import plot
from hpctrain.report.best import Best
from hpctrain.report.report import Report
from hpctrain.run import identity


def test_a_resumed_runs_elapsed_and_time_s_go_on_from_its_checkpoint(capsys):
    world = SimpleNamespace(chief=True, t_start=time.perf_counter())
    plan = SimpleNamespace(outputs=SimpleNamespace(metrics=None, tensorboard=None), lr=lambda step: 1e-3,
                           data=SimpleNamespace(tokens_per_sample=0))
    report = Report(world, plan, 10, timeline=None, best=Best(None))
    written = []
    report.metrics.write = written.append
    report.resume_at(4, SimpleNamespace(checkpoint=None, clock=(1000.0, 600.0, 300.0, 2)))
    report.progress(6, 1.0, 100, 1.0)
    assert 1000 <= written[0]["time_s"] < 1010, written
    assert " elapsed 100" in capsys.readouterr().out


def test_where_the_time_went_covers_every_run_of_a_resumed_one():
    final = {"event": "final", "wall_s": 10.0, "compute_s": 6.0, "comm_s": 3.0}
    assert plot.time_split({"final": final}) == (6.0, 3.0, 1.0)   # a file from before the totals
    final.update(total_wall_s=30.0, total_compute_s=18.0, total_comm_s=9.0, segments=3)
    assert plot.time_split({"final": final}) == (18.0, 9.0, 3.0)


def test_the_listing_and_the_resume_key_name_the_optimizers_own_settings():
    assert identity.unused_by("adam") == {"momentum"}
    assert identity.unused_by("momentum") == {"adam_betas"}
    assert identity.unused_by("sgd") == {"momentum", "adam_betas"}
