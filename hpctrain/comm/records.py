"""Short texts from every rank, gathered as fixed-width byte records.

Host names, device names, job settings: small strings each rank knows and
others must see. Lowercase `allgather` would pickle them; the house rule is
no pickle on the wire, so each text is zero-padded (or cut) to `width`
bytes and the records move with one buffer-form Allgather (or Gather).

Used by comm/agree.check_consistency, run/jobcheck.gather_layout, comm/nccl.py
and comm/topology.py. No MPI import here (and NumPy only when called).

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_records.py
"""


def _pack(values, width):
    """(n, width) uint8 records, zero-padded; str is UTF-8 encoded first."""
    import numpy as np
    records = np.zeros((len(values), width), np.uint8)
    for i, value in enumerate(values):
        raw = (value.encode() if isinstance(value, str) else bytes(value))[:width]
        records[i, : len(raw)] = np.frombuffer(raw, np.uint8)
    return records


def _unpack(record, as_text):
    raw = bytes(record).rstrip(b"\0")
    return raw.decode(errors="replace") if as_text else raw


def _normalize(values):
    """(list of values, was it one value?, is it text?)"""
    single = isinstance(values, (str, bytes, bytearray))
    values = [values] if single else list(values)
    as_text = bool(values) and isinstance(values[0], str)
    return values, single, as_text


def _rows(everyone, single, as_text):
    if single:
        return [_unpack(rank[0], as_text) for rank in everyone]
    return [[_unpack(field, as_text) for field in rank] for rank in everyone]


def allgather_bytes(comm, values, width):
    """Every rank's `values` on every rank, as a list indexed by rank.

    `values`: one str or bytes, or a list of them (the same count on every
    rank). str comes back as str (UTF-8, undecodable bytes replaced), bytes
    as bytes; each is cut to `width` bytes and its zero padding stripped.
    Collective over comm."""
    import numpy as np
    values, single, as_text = _normalize(values)
    mine = _pack(values, width)
    everyone = np.empty((comm.Get_size(), len(values), width), np.uint8)
    comm.Allgather(mine, everyone)
    return _rows(everyone, single, as_text)


def gather_bytes(comm, values, width, root=0):
    """allgather_bytes, to `root` only: the list there, None elsewhere."""
    import numpy as np
    values, single, as_text = _normalize(values)
    mine = _pack(values, width)
    is_root = comm.Get_rank() == root
    everyone = np.empty((comm.Get_size(), len(values), width), np.uint8) if is_root else None
    comm.Gather(mine, everyone, root=root)
    return _rows(everyone, single, as_text) if is_root else None
