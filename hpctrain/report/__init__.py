"""What a run tells its user: progress lines, the --metrics records, the
evaluations and the final record, --save and --keep-best (report.py), the
--timeline trace (timeline.py), the per-step statistics (step_stats.py).

    mpirun -n 2 python -m hpctrain.mnist --steps 300 --metrics m.jsonl --save p.h5
"""
