# mpich_segments.sh: sourced by tests/slurm/slurm_up.sh and tests/cluster/slurm.sh
# (both start a SLURM afresh); defines sweep_dead_mpich_segments.
# MPICH names a job's node-local segment /dev/shm/mpich_shm_<id of the job's
# PMI name>_<node>, and a rank killed outright leaves it behind. A SLURM
# started afresh numbers its jobs from 1 again, so a later job with the same
# number found the dead job's segment and died in MPI_Init ("Out of memory").
# Remove the ones no running process maps (a live job maps its own).
sweep_dead_mpich_segments() {
    local f live
    live=$(cat /proc/[0-9]*/maps 2>/dev/null | grep -o '/dev/shm/mpich_[a-z]*_[0-9a-f]*_[0-9]*' | sort -u)
    for f in /dev/shm/mpich_shm_* /dev/shm/mpich_vci_*; do
        [ -e "$f" ] || continue
        grep -qxF "$f" <<<"$live" || rm -f "$f"
    done
}
