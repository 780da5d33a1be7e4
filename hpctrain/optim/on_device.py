"""An optimizer whose parameters and state live on a device (CuPy), driven
through host arrays: a parameter server's --ps-device gpu (loops/ps.py).

    python -m pytest -q tests/test_optim.py -k on_device
"""
import numpy as np

from .base import Wrapper
from ..base.precision import FLOAT32


class OnDevice(Wrapper):
    """An optimizer whose parameters and state live on a device (CuPy), driven
    through host arrays: what a parameter server with --ps-device gpu needs,
    since its messages travel through host buffers. The host `params` and the
    arrays state() returns stay the ones the caller sends and receives; every
    step copies the gradient in and the parameters out. state() brings the
    device state to the host and marks the device copy stale (the caller may
    write into what it returned, as a restore does), so the next step first
    pushes host parameters and state back: the update is always the inner
    optimizer's, on the device, whatever happened on the host in between."""

    def __init__(self, inner, size, dtype=FLOAT32.optimizer):
        self.inner, self.xp = inner, inner.xp
        self._params = self.xp.zeros(size, dtype)
        self._grads = self.xp.zeros(size, dtype)
        self._host = {name: np.zeros(size, dtype) for name in inner.state_names}
        self._stale = True  # host parameters (set by the first restore) are the truth

    def state(self):
        for name, dev in self.inner.state().items():
            _to_host(dev, self._host[name])
        self._stale = True
        return self._host

    def step(self, params, grads, lr, grad_scale=1.0):
        if self._stale:
            _to_device(params, self._params)
            for name, dev in self.inner.state().items():
                _to_device(self._host[name], dev)
            self._stale = False
        _to_device(grads, self._grads)
        self.inner.step(self._params, self._grads, lr, grad_scale)
        _to_host(self._params, params)


def _to_device(host, dev):
    if isinstance(dev, np.ndarray):
        np.copyto(dev, host)
    else:
        dev.set(host)


def _to_host(dev, host):
    if isinstance(dev, np.ndarray):
        np.copyto(host, dev)
    else:
        dev.get(out=host)
