"""broadcast_object and allgather_object without pickle: JSON-able data and
arrays, encoded as bytes and moved as bytes.

The encoding: 8 bytes of little-endian header length, a JSON header
{"obj": ..., "arrays": [{"dtype", "shape", "offset", "torch"}]}, then the
arrays' raw bytes. Inside "obj" an array (NumPy, NumPy scalar, PyTorch
CPU tensor) is {"__array__": i}; a tuple {"__tuple__": [...]}; a dict
whose keys are not all strings (a torch optimizer's state_dict is keyed by
parameter index) {"__items__": [[key, value], ...]}. Anything else (a
function, a class instance) is one line naming its type: code never
crosses the wire. Decoding gives the same types back (a tensor only where
torch is imported already).

    python -c "from hpctrain.dist.objects import encode, decode; print(decode(encode({'lr': 0.1, 1: (2, 3)})))"
"""
import json
import sys

import numpy as np

from .arrays import is_torch
from .calls import Call, agree
from .collectives import _allgatherv, _bcast, _call, _root, refused_together, synchronize
from .errors import DistError

_SPECIAL = ("__array__", "__tuple__", "__items__")


def encode(obj):
    arrays, raw = [], []
    offset = [0]

    def add(arr, torch):
        arr = np.asarray(arr, order="C")   # 0-d stays 0-d (an optimizer's step; ascontiguousarray makes it 1-d)
        arrays.append({"dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset[0], "torch": torch})
        raw.append(arr.tobytes())
        offset[0] += arr.nbytes
        return {"__array__": len(arrays) - 1}

    def walk(o):
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        if isinstance(o, np.ndarray):
            if o.dtype.kind == "O":
                raise DistError("an object array cannot be sent: JSON-able data and arrays of numbers only (no pickle)")
            return add(o, False)
        if isinstance(o, np.generic):
            return add(np.asarray(o), "scalar")
        if is_torch(o):
            return add(o.detach().cpu().numpy(), True)
        if isinstance(o, (list, tuple)):
            items = [walk(v) for v in o]
            return items if isinstance(o, list) else {"__tuple__": items}
        if isinstance(o, dict):
            if all(isinstance(k, str) for k in o) and not any(k in _SPECIAL for k in o):
                return {k: walk(v) for k, v in o.items()}
            return {"__items__": [[walk(k), walk(v)] for k, v in o.items()]}
        raise DistError(f"a {type(o).__name__} cannot be sent: JSON-able data and arrays only (no pickle)")

    header = json.dumps({"obj": walk(obj), "arrays": arrays}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(raw)


def decode(data):
    data = bytes(data)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    torch = sys.modules.get("torch")

    def array(i):
        a = header["arrays"][i]
        dtype = np.dtype(a["dtype"])
        count = int(np.prod(a["shape"], dtype=np.int64))
        arr = np.frombuffer(body, dtype, count, a["offset"]).reshape(a["shape"]).copy()
        if a["torch"] == "scalar":
            return arr[()]
        if a["torch"] and torch is not None:
            return torch.from_numpy(arr)
        return arr

    def walk(o):
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, dict):
            if set(o) == {"__array__"}:
                return array(o["__array__"])
            if set(o) == {"__tuple__"}:
                return tuple(walk(v) for v in o["__tuple__"])
            if set(o) == {"__items__"}:
                return {_key(walk(k)): walk(v) for k, v in o["__items__"]}
            return {k: walk(v) for k, v in o.items()}
        return o

    return walk(header["obj"])


def _key(k):
    return tuple(k) if isinstance(k, list) else k


@refused_together
def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """root_rank's obj on every rank of the set (JSON-able data and arrays)."""
    root = _root(process_set, root_rank, "broadcast_object")

    def work(g):
        try:
            data = np.frombuffer(encode(obj), np.uint8) if g.rank == root else np.empty(0, np.uint8)
        except DistError as e:   # (the root's: the others learn it from the fingerprint, calls.agree)
            agree(g, None, 0, refused=e)
        call = Call("broadcast_object", np.uint8, (data.size if g.rank == root else -1,), root=root, name=name)
        ag = agree(g, call, 0)
        buf = data if g.rank == root else np.empty(ag.rows[root], np.uint8)
        _bcast(g, buf, root)
        return obj if g.rank == root else decode(buf)
    return synchronize(_call(work, "broadcast_object()", process_set, now=True))


@refused_together
def allgather_object(obj, name=None, process_set=None):
    """Every rank's obj, as a list in rank order."""
    data = np.frombuffer(encode(obj), np.uint8)

    def work(g):
        call = Call("allgather_object", np.uint8, (data.size,), name=name)
        ag = agree(g, call, 0)
        out = _allgatherv(g, data, ag.rows, 1, np.uint8)
        bounds = np.concatenate([[0], np.cumsum(ag.rows)])
        return [decode(out[bounds[i]:bounds[i + 1]]) for i in range(g.size) if not ag.joined[i]]
    return synchronize(_call(work, "allgather_object()", process_set, now=True))
