#!/bin/bash
# polca's Slurm Prolog: give the GPUs of the job starting on this node a priority class.
#
# slurm.conf:  Prolog=/etc/slurm/polca-prolog.sh   (see README.md in this folder)
#
# Runs as SlurmdUser (root) on each node of the job, before the job's first step (or at
# allocation with PrologFlags=Alloc), with no PATH set. It must never fail the job: Slurm
# drains a node whose Prolog exits non-zero and requeues the job. So every failure of
# `polca assign` (broker away, node unknown, credentials refused) is logged and the script
# exits 0; the GPUs then keep their previous class (the policy's default for a fresh map).

# --- The class of a job -------------------------------------------------------------
# "name=class" pairs, first match wins. The QOS is tried first, but the slurmd Prolog does
# not get SLURM_JOB_QOS (Slurm exports it to the task and srun prologs only), so on most
# sites the partition decides. Classes must exist in the node policy: the agent refuses an
# assignment naming an unknown class (and logs it), keeping the previous one.
QOS_CLASSES="high=high normal=normal low=low scavenger=low"
PARTITION_CLASSES="inference=high interactive=high gpu=normal batch=normal preempt=low"
# The class of a job matching no line; empty: leave its GPUs alone.
DEFAULT_CLASS="${POLCA_DEFAULT_CLASS-normal}"

# --- How polca is reached -----------------------------------------------------------
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"
POLCA="${POLCA:-polca}"
# The scheduler's settings: mqtt (host, username polca-scheduler, password_file), site.
CONFIG="${POLCA_ASSIGN_CONFIG:-/etc/polca/assign.yaml}"
TIMEOUT_S="${POLCA_ASSIGN_TIMEOUT:-5}"
[[ "$TIMEOUT_S" =~ ^[1-9][0-9]{0,3}$ ]] || TIMEOUT_S=5 # whole seconds

log() {
    logger -t polca-prolog -- "$*" 2>/dev/null
    echo "polca-prolog: $*" >&2
}

# The job's GPUs on this node, one per line: indices (ranges such as 0-3 expanded) or
# UUIDs. SLURM_JOB_GPUS (Prolog and Epilog), else CUDA_VISIBLE_DEVICES (set for the
# Prolog to the node's device indices), else SLURM_STEP_GPUS (step prologs).
job_gpus() {
    local list="${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-${SLURM_STEP_GPUS:-}}}"
    local item first last
    local IFS=','
    for item in $list; do
        item="${item// /}"
        if [[ "$item" =~ ^([0-9]+)-([0-9]+)$ ]]; then
            first="${BASH_REMATCH[1]}"
            last="${BASH_REMATCH[2]}"
            while ((10#$first <= 10#$last)); do
                echo "$((10#$first))"
                first=$((10#$first + 1))
            done
        elif [[ "$item" =~ ^[0-9]+$ ]]; then
            echo "$((10#$item))"
        elif [[ "$item" =~ ^(GPU|MIG)-[A-Za-z0-9_.:/-]+$ ]]; then
            echo "$item"
        fi # anything else (NoDevFiles, -1): not a GPU
    done
}

# The class of "$1" in the pairs "$2"; nothing when no pair names it.
lookup() {
    local pair
    [[ -n "$1" ]] || return 0
    for pair in $2; do
        if [[ "${pair%%=*}" == "$1" ]]; then
            echo "${pair#*=}"
            return 0
        fi
    done
}

job_class() {
    local class
    class="$(lookup "${SLURM_JOB_QOS:-}" "$QOS_CLASSES")"
    [[ -n "$class" ]] || class="$(lookup "${SLURM_JOB_PARTITION:-}" "$PARTITION_CLASSES")"
    echo "${class:-$DEFAULT_CLASS}"
}

main() {
    local job="${SLURM_JOB_ID:-?}"
    local node class output status
    local -a args=()
    node="${POLCA_NODE:-$(hostname -s)}"
    class="$(job_class)"
    while read -r gpu; do
        [[ -n "$gpu" ]] && args+=(--gpu "$gpu")
    done < <(job_gpus)
    if ((${#args[@]} == 0)); then
        return 0 # no GPUs on this node: nothing to assign
    fi
    if [[ -z "$class" ]]; then
        log "job $job: no class for QOS '${SLURM_JOB_QOS:-}' or partition '${SLURM_JOB_PARTITION:-}'; GPUs left as they are"
        return 0
    fi
    args=(assign --node "$node" "${args[@]}" --class "$class" --timeout "$TIMEOUT_S")
    [[ -f "$CONFIG" ]] && args+=(--config "$CONFIG")
    if command -v timeout >/dev/null 2>&1; then
        output="$(timeout "$((TIMEOUT_S * 2 + 5))" "$POLCA" "${args[@]}" 2>&1)"
    else
        output="$("$POLCA" "${args[@]}" 2>&1)"
    fi
    status=$?
    if ((status != 0)); then
        log "job $job: polca assign failed (exit $status), GPUs keep their class: $output"
    fi
    return 0
}

main
exit 0
