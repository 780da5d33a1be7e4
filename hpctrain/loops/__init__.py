"""The three training loops and what they share: frame.py owns a run's start
and end, ring.py (with ring_step.py), ps.py and pipe.py each hold their step.

    mpirun -n 4 python -m hpctrain.train            # loops/ring.py
"""
