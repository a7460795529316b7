#!/bin/bash
# polca's Slurm Epilog: remove the priority class of the GPUs of the job ending on this node.
#
# slurm.conf:  Epilog=/etc/slurm/polca-epilog.sh   (see README.md in this folder)
#
# Runs as SlurmdUser (root) on each node of the job when the allocation is released, with
# no PATH set. Only this job's GPUs are cleared (other jobs may share the node), and only
# when Slurm names them; nothing is cleared otherwise. Never fails: Slurm drains a node
# whose Epilog exits non-zero, so a failure of `polca assign` is logged and the script
# exits 0 (the GPUs keep the finished job's class until the next job's Prolog sets theirs).

PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"
POLCA="${POLCA:-polca}"
CONFIG="${POLCA_ASSIGN_CONFIG:-/etc/polca/assign.yaml}"
TIMEOUT_S="${POLCA_ASSIGN_TIMEOUT:-5}"
[[ "$TIMEOUT_S" =~ ^[1-9][0-9]{0,3}$ ]] || TIMEOUT_S=5 # whole seconds

log() {
    logger -t polca-epilog -- "$*" 2>/dev/null
    echo "polca-epilog: $*" >&2
}

# The job's GPUs on this node, as the Prolog finds them (prolog.sh has the details).
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
        fi
    done
}

main() {
    local job="${SLURM_JOB_ID:-?}"
    local node output status
    local -a args=()
    node="${POLCA_NODE:-$(hostname -s)}"
    while read -r gpu; do
        [[ -n "$gpu" ]] && args+=(--gpu "$gpu")
    done < <(job_gpus)
    if ((${#args[@]} == 0)); then
        return 0 # Slurm named no GPUs: clear nothing rather than the whole node
    fi
    args=(assign --node "$node" "${args[@]}" --clear --timeout "$TIMEOUT_S")
    [[ -f "$CONFIG" ]] && args+=(--config "$CONFIG")
    if command -v timeout >/dev/null 2>&1; then
        output="$(timeout "$((TIMEOUT_S * 2 + 5))" "$POLCA" "${args[@]}" 2>&1)"
    else
        output="$("$POLCA" "${args[@]}" 2>&1)"
    fi
    status=$?
    if ((status != 0)); then
        log "job $job: polca assign --clear failed (exit $status), GPUs keep the job's class: $output"
    fi
    return 0
}

main
exit 0
