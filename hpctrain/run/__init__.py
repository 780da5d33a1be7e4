"""One run's set-up: the MPI world it runs in (world.py), everything the
flags, the world and the data decide once (plan.py), the job identity ranks
compare and checkpoints record (identity.py), the cluster's roles and this
node's facts (cluster.py), the mesh of process groups (mesh.py), the launch layout (jobcheck.py), the outputs'
checks (outputs.py), the stop signal (stop_signal.py), and the start-up
that makes them in order (startup.py).

    python -c "from hpctrain.run import cluster; print(cluster.cores_available())"
"""
