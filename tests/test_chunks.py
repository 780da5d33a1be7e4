"""The one near-equal partition (hpctrain/base/chunks.py) and its users agree.

    .venv/bin/python -m pytest -q tests/test_chunks.py
"""
from hpctrain.base.chunks import chunk_bounds, chunk_parts
from hpctrain.comm.ps.placement import place


def test_chunk_parts_are_the_bounds_paired_and_even_placement_uses_them():
    for n in (0, 1, 5, 17, 1000):
        for parts in (1, 2, 3, 7):
            b = chunk_bounds(n, parts)
            assert chunk_parts(n, parts) == list(zip(b[:-1], b[1:]))
            even = place([("w", 0, n)], parts, "even")
            assert even == [[p] if p[1] > p[0] else [] for p in chunk_parts(n, parts)]
