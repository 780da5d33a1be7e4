#!/usr/bin/env bash
# jobs/launch.sh HPCTRAIN-FLAGS... -- what jobs/ring.slurm and jobs/ps.slurm share.
#
# `exec`'d by them inside the batch job (so this process IS the batch shell and
# receives the batch shell's signals). It
#   1. sources jobs/env.sh (modules, venv, launcher choice),
#   2. exports HPCTRAIN_EXPECT_WORLD_SIZE=$SLURM_NTASKS, so hpctrain stops with
#      one clear line when the launcher made N worlds of size 1 instead of one,
#   3. runs `python -m hpctrain.mnist --checkpoint-dir DIR --checkpoint-every N
#      --resume auto FLAGS...` under srun (or mpirun), in the background, and
#      forwards USR1/TERM to it (as USR1: see below),
#   4. on exit code 75 (stopped by a signal, checkpoint written) requeues the
#      job with `scontrol requeue`, so it resumes by itself from the checkpoint,
#   5. once hpctrain's chief has written its final record (HPCTRAIN_FINISHED_FILE),
#      waits at most --timeout + 5 s more for the launcher: a rank that hangs
#      after MPI_Finalize is ended by its own watcher first (hpctrain/comm/
#      exit_guard.py; the launcher then exits 9, and this script 3), and if
#      that did not happen this script ends it (exit 3: the results are written);
#      a launcher that exits 0 without that record is a failure (exit 1),
#   6. when a rank's process dies of a signal (SIGKILL: the OOM killer), names
#      the rank: MPICH's mpirun says only "PID n RUNNING AT host", and
#      hpctrain's chief wrote each rank's pid to HPCTRAIN_RANKS_FILE at start-up,
#   7. with --on-failure shrink among the flags, launches mpirun --with-ft ulfm
#      (env.sh; srun does not carry ULFM), and when Open MPI loses a node's
#      daemon (its runtime then ends every rank, ULFM or not) names the node
#      and requeues as after a stop (jobs/README.md),
#   8. when the launcher fails otherwise before the final record, runs one task
#      on every node of the job: a node that does not answer was lost (the run
#      ended before slurmctld marked it down and requeued the job itself), and
#      the job is requeued as after a stop.
#
# Exit codes: 0 training finished, or stopped and requeued (the requeued run
# continues); 75 stopped with a checkpoint but not requeued (requeue limit
# reached, disabled or refused: resubmit the same command to continue);
# 2 bad set-up (this script, env.sh, or hpctrain's bad-input errors); any other
# code is hpctrain's (see hpctrain/base/errors.py), passed through unchanged.
# Variables: see jobs/README.md and jobs/env.sh.
set -uo pipefail

EXIT_PREEMPTED=75                      # hpctrain/base/errors.py
say() { echo "hpctrain-job: $*"; }
die() { echo "hpctrain-job: error: $*" >&2; exit 2; }

if [ -z "${HPCTRAIN_HOME:-}" ]; then
    HPCTRAIN_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fi
export HPCTRAIN_HOME
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a SLURM job: submit with 'sbatch jobs/ring.slurm' (or run under salloc)"

# Ranks in the job: what the one MPI world must have.
HPCTRAIN_NTASKS=${SLURM_NTASKS:-${SLURM_NPROCS:-}}
[ -n "$HPCTRAIN_NTASKS" ] || die "SLURM_NTASKS is not set: request tasks (--ntasks-per-node) in the job script"
export HPCTRAIN_EXPECT_WORLD_SIZE=$HPCTRAIN_NTASKS

# Checked before anything runs: a limit that is not a number would make the
# requeue test below fail (an error, read as false) and requeue without bound.
MAX_REQUEUES=${HPCTRAIN_MAX_REQUEUES:-10}
case $MAX_REQUEUES in
    ''|*[!0-9]*) die "HPCTRAIN_MAX_REQUEUES=$MAX_REQUEUES: expected a whole number of requeues (0: never)" ;;
esac

# flag_value NAME ARGS...: the value the training flags ARGS give NAME
# (--NAME VALUE or --NAME=VALUE; the last one given wins, as for the
# program), empty where none does.
flag_value() {
    local name=$1 prev="" arg value=""
    shift
    for arg in "$@"; do
        case $arg in "$name"=*) value=${arg#*=} ;; esac
        if [ "$prev" = "$name" ]; then value=$arg; fi
        prev=$arg
    done
    printf '%s' "$value"
}

# --on-failure shrink: env.sh picks the launcher that carries ULFM (mpirun --with-ft ulfm).
HPCTRAIN_ON_FAILURE=$(flag_value --on-failure "$@")

# shellcheck source=jobs/env.sh
. "$HPCTRAIN_HOME/jobs/env.sh"

# ---- checkpoints: one directory per job NAME, not per job id -----------------
# A requeued job keeps its id, but a job resubmitted by hand gets a new one; the
# name (sbatch -J) is what both share. An explicit --checkpoint-dir flag wins.
RESTARTS=${SLURM_RESTART_COUNT:-0}
# Array tasks share a name: each gets its own directory (the task id is stable too).
RUN_NAME=${SLURM_JOB_NAME:-hpctrain}${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}
CKPT_DIR=$(flag_value --checkpoint-dir "$@")
CKPT_DIR=${CKPT_DIR:-${HPCTRAIN_CHECKPOINT_DIR:-${HPCTRAIN_CHECKPOINT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/runs}/$RUN_NAME}}
mkdir -p "$CKPT_DIR" || die "cannot create checkpoint directory $CKPT_DIR"

# ---- --timeout above SlurmdTimeout ----------------------------------------------
# When a node dies, SLURM marks it down after SlurmdTimeout and requeues the
# job (--requeue in the job scripts); meanwhile the ranks on the other nodes
# wait for it. hpctrain's --timeout must not end them first (exit 3 is not
# requeued), so unless the flags name one it is at least 2 x SlurmdTimeout + 60 s.
TIMEOUT_FLAGS=()
case " $* " in
    *" --timeout "*|*" --timeout="*) ;;
    *)
        slurmd_timeout=$(scontrol show config 2>/dev/null | sed -n 's/^SlurmdTimeout *= *\([0-9]*\) sec.*/\1/p')
        if [ -n "$slurmd_timeout" ] && [ $((2 * slurmd_timeout + 60)) -gt 300 ]; then
            TIMEOUT_FLAGS=(--timeout $((2 * slurmd_timeout + 60)))
            say "--timeout $((2 * slurmd_timeout + 60)): above 2 x SlurmdTimeout ($slurmd_timeout s), so SLURM requeues the job after a node failure before hpctrain gives up"
        fi
        ;;
esac

CMD=("$HPCTRAIN_PYTHON" -m hpctrain.mnist
     --checkpoint-dir "$CKPT_DIR" --checkpoint-every "${HPCTRAIN_CHECKPOINT_EVERY:-500}" --resume auto
     "${TIMEOUT_FLAGS[@]}" "$@")
# hpctrain's --timeout as the command line gives it (the last one wins), for
# the wait after the final record; 300: hpctrain/flags/cli.py's default.
TIMEOUT_S=300
prev=""
for arg in "${CMD[@]}"; do
    case $arg in --timeout=*) TIMEOUT_S=${arg#*=} ;; esac
    [ "$prev" = --timeout ] && TIMEOUT_S=$arg
    prev=$arg
done
TIMEOUT_S=${TIMEOUT_S%%.*}          # whole seconds are enough here
case $TIMEOUT_S in ''|*[!0-9]*) TIMEOUT_S=300 ;; esac   # hpctrain itself refuses a bad one
# The ranks' own deadlines come first (and name the rank): a rank that stands
# still on its way out is killed by its exit watcher --timeout after its last
# heartbeat, which comes after the final record by the shutdown barrier and
# MPI_Finalize, plus the watcher's 0.5 s poll (1 s in all with --timeout 3 on
# the loaded 2-core test machine); FINISH_MARGIN_S is what this script adds.
FINISH_MARGIN_S=5
FINISH_GRACE_S=$((TIMEOUT_S + FINISH_MARGIN_S))
# On the shared file system, where the chief (on whichever node) can write it.
export HPCTRAIN_FINISHED_FILE="$CKPT_DIR/.finished-${SLURM_JOB_ID}-$RESTARTS"
rm -f "$HPCTRAIN_FINISHED_FILE"
# rank host pid, a line, from the chief at start-up (hpctrain/run/jobcheck.py);
# DEAD_FILE: the pid and host of a rank the launcher saw die (MPICH's banner).
export HPCTRAIN_RANKS_FILE="$CKPT_DIR/.ranks-${SLURM_JOB_ID}-$RESTARTS"
DEAD_FILE="$CKPT_DIR/.dead-${SLURM_JOB_ID}-$RESTARTS"
# LOST_FILE: the node whose Open MPI daemon (prted) was lost, from mpirun's
# banner: Open MPI 5's runtime ends the whole job then, ULFM or not.
LOST_FILE="$CKPT_DIR/.lost-${SLURM_JOB_ID}-$RESTARTS"
rm -f "$HPCTRAIN_RANKS_FILE" "$DEAD_FILE" "$LOST_FILE"
# A requeued run must continue even if the first run said --resume no.
[ "$RESTARTS" -gt 0 ] && CMD+=(--resume auto)

say "job ${SLURM_JOB_ID} '${SLURM_JOB_NAME:-}' run $((RESTARTS + 1)) (restart $RESTARTS)," \
    "${SLURM_JOB_NUM_NODES:-1} node(s) ${SLURM_JOB_NODELIST:-?}, $HPCTRAIN_NTASKS tasks"
say "checkpoints: $CKPT_DIR"
say "launch: ${HPCTRAIN_LAUNCH[*]} ${CMD[*]}"

# ---- run, forwarding the stop signals ---------------------------------------------
# The job scripts use --signal=B:USR1@120: before the time limit SLURM signals
# only this shell, so it must pass the signal on (with mpirun the ranks are
# children of this shell, outside any job step, and no one else would tell them).
# Whatever arrives (USR1 from --signal, TERM from `scancel --batch`/preemption)
# is forwarded as USR1: hpctrain treats both alike, and launchers just relay
# USR1, whereas some (Open MPI's mpirun) turn a TERM into killing the ranks.
# Ranks that also get the signal directly (scancel --signal=TERM signals the
# job steps; preemption signals every process) are fine: one stop either way.
SIGNALED=""
LAUNCHER_PID=""
forward() {
    SIGNALED=$1
    say "got SIG$1: asking hpctrain to checkpoint and stop"
    [ -n "$LAUNCHER_PID" ] && kill -USR1 "$LAUNCHER_PID" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward INT' INT

# The launcher's standard output passes through awk, line by line as it
# comes, which keeps what MPICH's "BAD TERMINATION" banner says of the first
# process that died ("=   PID 4242 RUNNING AT node1", then "... EXIT STRING:
# Killed (signal 9)") for the rank's name at the end. awk ignores the stop
# signals (preemption signals every process of the job): the launcher must
# not lose its standard output, and die of SIGPIPE, while the ranks checkpoint.
exec {OUT_FD}> >(trap '' TERM INT HUP USR1 USR2; exec awk -v dead="$DEAD_FILE" '{ print; fflush() }
    /^=   PID [0-9]+ RUNNING AT / && !pid { pid = $3; host = $6 }
    /TERMINATED WITH THE EXIT STRING: .*\(signal [0-9]+\)/ && pid && !said {
        sub(/.*EXIT STRING: /, ""); print pid, host, $0 > dead; fflush(dead); said = 1 }')
FILTER_PID=$!
# Standard error likewise, for Open MPI's word of a lost daemon (the node named in it);
# read by bash, a line as it comes (mawk reads a pipe in blocks: the line would
# wait there while a process that outlived the launcher holds the pipe open).
exec {ERR_FD}> >(trap '' TERM INT HUP USR1 USR2
    while IFS= read -r line || [ -n "$line" ]; do
        printf '%s\n' "$line" >&2
        case $line in *"Remote daemon: "*" on node "*) [ -s "$LOST_FILE" ] || echo "${line##* }" > "$LOST_FILE" ;; esac
    done)
ERR_FILTER_PID=$!
"${HPCTRAIN_LAUNCH[@]}" "${CMD[@]}" >&"$OUT_FD" 2>&"$ERR_FD" &
LAUNCHER_PID=$!
exec {OUT_FD}>&- {ERR_FD}>&-   # the launcher holds the pipes now: the awks end with them
# Polled 5 times a second (a trapped signal interrupts the `wait` on the sleep
# at once), so the job ends soon after the launcher: after the chief's final
# record the launcher gets FINISH_GRACE_S more.
finished_at=""
while kill -0 "$LAUNCHER_PID" 2>/dev/null; do
    if [ -z "$finished_at" ] && [ -e "$HPCTRAIN_FINISHED_FILE" ]; then
        finished_at=$SECONDS
    fi
    if [ -n "$finished_at" ] && [ $((SECONDS - finished_at)) -ge "$FINISH_GRACE_S" ]; then
        # The ranks still there go with the job when this script ends (SLURM
        # ends every step of a job whose batch script has exited).
        kill -KILL "$LAUNCHER_PID" 2>/dev/null
        wait "$LAUNCHER_PID" 2>/dev/null
        rm -f "$HPCTRAIN_FINISHED_FILE"
        echo "hpctrain-job: error: hpctrain's chief wrote its final record (the results are written)" \
            "$((SECONDS - finished_at)) s ago and ${HPCTRAIN_LAUNCH[0]##*/} has not ended: a rank hangs on" \
            "its way out; killed the job step (--timeout $TIMEOUT_S + $FINISH_MARGIN_S s), exit 3" >&2
        exit 3
    fi
    sleep 0.2 &
    wait $! 2>/dev/null
done
# `wait` returns early (>128) when a trapped signal arrives: wait again until
# the launcher has really exited.
while :; do
    wait "$LAUNCHER_PID"
    rc=$?
    kill -0 "$LAUNCHER_PID" 2>/dev/null || break
done
# (the launcher may have ended within the second after the record was written)
[ -z "$finished_at" ] && [ -e "$HPCTRAIN_FINISHED_FILE" ] && finished_at=$SECONDS
rm -f "$HPCTRAIN_FINISHED_FILE"
trap - USR1 TERM INT
# awk has the banner's last line once it has seen the pipe close (a rank
# that outlives the launcher may hold it: waited for 5 s at most).
for _ in $(seq 50); do kill -0 "$FILTER_PID" 2>/dev/null || kill -0 "$ERR_FILTER_PID" 2>/dev/null || break; sleep 0.1; done
# A rank that died of a signal before the run finished (not one its exit
# watcher killed after the results, nor the stop this script passed on): its
# rank, from the pid in MPICH's banner and the chief's map (pids are per host:
# the map's host is the one the rank's own hostname gave, the banner's may be
# spelt otherwise, so the pid alone finds it where it is unique).
if [ "$rc" -ne 0 ] && [ -z "$finished_at" ] && [ -z "$SIGNALED" ] && [ -s "$DEAD_FILE" ] \
        && [ -s "$HPCTRAIN_RANKS_FILE" ]; then
    read -r dead_pid dead_host dead_why < "$DEAD_FILE"
    dead_rank=$(awk -v pid="$dead_pid" -v host="$dead_host" '$3 == pid { n++; r = $1; if ($2 == host) { h = $1 } }
        END { if (h != "") print h; else if (n == 1) print r }' "$HPCTRAIN_RANKS_FILE")
    if [ -n "$dead_rank" ]; then
        case $dead_why in *"(signal 9)"*) dead_why="$dead_why: SIGKILL, e.g. the kernel's OOM killer or kill -9" ;; esac
        echo "hpctrain-job: error: rank $dead_rank (pid $dead_pid on $dead_host) died before the run finished" \
            "($dead_why); ${HPCTRAIN_LAUNCH[0]##*/} ended the other ranks, exit $rc" >&2
    fi
fi
lost_node=""
[ -s "$LOST_FILE" ] && read -r lost_node < "$LOST_FILE"
rm -f "$HPCTRAIN_RANKS_FILE" "$DEAD_FILE" "$LOST_FILE"
if [ -n "$lost_node" ] && [ -z "$finished_at" ] && [ -z "$SIGNALED" ]; then
    # mpirun then ends every rank and exits 0 (Open MPI 5.0's runtime, PRRTE 3, has no
    # recovery from a lost daemon; --on-failure shrink survives lost ranks, not this):
    # the checkpoint-and-requeue path, as after a stop.
    echo "hpctrain-job: error: Open MPI lost its daemon on node $lost_node (the node, or all of the job's processes" \
        "on it, died) and its runtime ended every rank; going on from the last checkpoint in $CKPT_DIR" >&2
    rc=$EXIT_PREEMPTED
fi
# A node that died can end the run before slurmctld marks it down (SlurmdTimeout
# later) and requeues the job: the ranks on the other nodes may fail at once
# when their peer's connections close (MPICH's did, under srun), and srun then
# exits with their status, the batch script with it, and the job is over with
# no requeue. So a run that failed unexplained asks every node of the
# allocation for one task; a node that does not answer was lost, and the run
# goes on from its checkpoint as after a stop. The batch node always answers:
# where none did, the probe itself failed and says nothing. Not asked after
# hpctrain's own verdicts on the run (2 bad input, 4 diverged): no lost peer ends so.
if [ "$rc" -ne 0 ] && [ "$rc" -ne "$EXIT_PREEMPTED" ] && [ "$rc" -ne 2 ] && [ "$rc" -ne 4 ] \
        && [ -z "$finished_at" ] && [ -z "$SIGNALED" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    job_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null)
    n=$(wc -w <<< "$job_nodes")
    answered=$(timeout 60 srun --overlap --mpi=none --nodes="$n" --ntasks="$n" --ntasks-per-node=1 \
        bash -c 'echo "$SLURMD_NODENAME"' 2>/dev/null)
    silent=""
    if [ -n "$answered" ]; then
        for node in $job_nodes; do
            grep -qxF "$node" <<< "$answered" || silent="$silent${silent:+,}$node"
        done
    fi
    if [ -z "$answered" ]; then
        say "${HPCTRAIN_LAUNCH[0]##*/} exited $rc; whether a node of the job was lost is not known (srun could not" \
            "run a task on any of them)"
    elif [ -n "$silent" ]; then
        echo "hpctrain-job: error: ${HPCTRAIN_LAUNCH[0]##*/} exited $rc and node(s) $silent of the job no longer" \
            "answer: the run ended with them; going on from the last checkpoint in $CKPT_DIR" >&2
        rc=$EXIT_PREEMPTED
    else
        say "${HPCTRAIN_LAUNCH[0]##*/} exited $rc; every node of the job answers: no node was lost"
    fi
fi

# ---- exit code -> requeue or not ------------------------------------------------------
if [ "$rc" -eq 0 ] && [ -n "$SIGNALED" ]; then
    # SLURM cancelled the step (node failure, scancel) and the launcher did not
    # pass on an exit code: whether training ended is not known here.
    say "the launcher exited 0 after SIG$SIGNALED (job step cancelled by SLURM?); checkpoints stay in $CKPT_DIR"
    exit 0
fi
if [ "$rc" -eq 0 ] && [ -z "$finished_at" ]; then
    # Every rank ended with status 0, but the chief never wrote its final
    # record: a process ended without finishing (os._exit(0) in a model
    # file; MPICH's mpirun then kills the other ranks and reports 0). Not
    # requeued: the same code would end the same way.
    echo "hpctrain-job: error: ${HPCTRAIN_LAUNCH[0]##*/} exited 0, but hpctrain's chief wrote no final record: a" \
        "rank ended the process before the run finished (os._exit or sys.exit in the model's code?); no result," \
        "exit 1" >&2
    exit 1
fi
if [ "$rc" -eq 0 ]; then
    say "finished"
    exit 0
fi
if [ -n "$finished_at" ] && { [ "$rc" -eq 9 ] || [ "$rc" -eq 137 ]; }; then
    # A rank stood still on its way out, after the results were written, and
    # its watcher killed it (hpctrain/comm/exit_guard.py said so above): the
    # results are whole; exit 3, as for any rank that passed --timeout.
    say "the results are written; a rank that hung on its way out was killed (exit $rc), exit 3"
    exit 3
fi
# 75: hpctrain stopped after a signal and wrote its checkpoint. A launcher
# killed by a signal (>128) right after we were signalled means the ranks died
# before installing their handler (start-up): requeue too, --resume auto will
# start from whatever checkpoint exists.
if [ "$rc" -eq "$EXIT_PREEMPTED" ] || { [ -n "$SIGNALED" ] && [ "$rc" -gt 128 ]; }; then
    MAX=$MAX_REQUEUES
    if [ "$RESTARTS" -ge "$MAX" ]; then
        say "stopped (exit $rc), checkpoint in $CKPT_DIR; not requeued: restart $RESTARTS reached HPCTRAIN_MAX_REQUEUES=$MAX." \
            "Resubmit with the same job name to continue."
        exit "$EXIT_PREEMPTED"
    fi
    # Said before asking: a successful `scontrol requeue` makes SLURM end this
    # script at once ("CANCELLED ... DUE TO JOB REQUEUE"), often before a line
    # after it is written (CI lost it so). TERM is ignored from here on, so
    # the failure line below is not cut off either.
    say "stopped (exit $rc), checkpoint in $CKPT_DIR; requeueing job $SLURM_JOB_ID (restart $((RESTARTS + 1)) of at most $MAX): it resumes from the checkpoint"
    trap '' TERM
    if out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
        exit 0
    fi
    case $out in *"pending execution"*)
        # SLURM came first: after a node failure it cancels the step (this
        # script got TERM, the ranks crashed or stopped) and requeues the job.
        say "SLURM has requeued job $SLURM_JOB_ID itself (a node failure?): it resumes from the checkpoint in $CKPT_DIR"
        exit 0 ;;
    esac
    say "stopped (exit $rc), checkpoint in $CKPT_DIR; scontrol requeue failed: $out." \
        "Resubmit with the same job name to continue."
    exit "$EXIT_PREEMPTED"
fi
# 4: the loss diverged (inf/nan); 2: bad input; 3: a rank stalled past --timeout.
# None of them is requeued: the same run would fail the same way.
say "hpctrain failed with exit code $rc"
exit "$rc"
