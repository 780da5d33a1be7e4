"""Near-equal contiguous chunks of range(n): the one partition that the
collectives (a strategy's shards), the ps servers' `even` placement and the
test set's evaluation parts all use.

It lives at the top of the package, in neither data/ nor comm/: both import
it, and data/ never imports comm/ (the MPI side of the house).

    python -c "from hpctrain.base.chunks import chunk_parts; print(chunk_parts(10, 3))"
"""


def chunk_bounds(n, parts):
    """Start offsets of `parts` near-equal chunks of n elements (parts+1 values):
    chunk i is [b[i], b[i+1]); chunks are empty where parts exceeds n."""
    return [i * n // parts for i in range(parts + 1)]


def chunk_parts(n, parts):
    """The (lo, hi) of each of chunk_bounds(n, parts)'s chunks, in order."""
    bounds = chunk_bounds(n, parts)
    return list(zip(bounds[:-1], bounds[1:]))
