"""Faults in a pipeline: a stage that stops mid-training ends the whole job
within --timeout with one line naming its rank (exit 3), never a hang of the
stages waiting for its activations or gradients.

    .venv/bin/python -m pytest -q tests/faults/test_pipeline_stall.py
"""
from test_stalls import errors, stall


def test_a_stopped_stage_is_named_within_the_deadline(job):
    rc, out, err, took = stall(3, 1, ["--pipeline-stages", "3", "--micro-batches", "2", "--hidden", "64,32",
                                      "--steps", "1000000", "--log-every", "1000000", "--timeout", "4"],
                               after_s=3.0)
    assert rc == 3, err
    lines = errors(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("hpctrain: error: rank 1 stopped responding"), lines
    assert took < 40
