"""The layout of the exchanged buffer (comm/wire.py): [loss, stop, grads...].

    python -m pytest -q tests/test_wire.py
"""
import numpy as np

from collectives import stop_requested
from hpctrain.comm import wire as wire_mod
from hpctrain.comm.fusion import bucket_bounds
from hpctrain.comm.wire import Wire
from hpctrain.nn import mlp


def test_views_share_one_buffer_in_front_of_the_gradients():
    model_grads = mlp(hidden=(64, 32)).num_params
    w = Wire(model_grads)
    assert w.size == w.buffer.size == model_grads + 2 and w.buffer.dtype == np.float32
    w.buffer[:] = np.arange(w.size)
    assert w.loss[0] == wire_mod.LOSS == 0 and w.stop[0] == wire_mod.STOP == 1
    assert w.body[0] == wire_mod.GRADS == 2 and w.body.size == model_grads
    w.body[:] = 0
    assert not w.buffer[2:].any()
    w.set_stop(True)
    assert stop_requested(w) and w.buffer[1] == 1.0
    w.set_stop(False)
    assert not stop_requested(w) and w.buffer[1] == 0.0


def test_ready_from_and_grads_range_are_the_loops_offsets():
    model = mlp(hidden=(64, 32)).build()
    w = Wire(model.num_params)
    ready = w.ready_from(model.layer_ranges)
    assert ready == [0] + [2 + lo for lo, _ in model.layer_ranges[1:]]
    assert ready[0] == 0 and ready == sorted(ready)
    for lo, hi in bucket_bounds(w.size, 100, ready):
        assert w.body_range(lo, hi) == (max(lo - 2, 0), hi - 2)
    assert w.body_range(0, w.size) == (0, model.num_params)
