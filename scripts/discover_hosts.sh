#!/bin/sh
# Host discovery for elastic runs: horovodrun --host-discovery-script calls this about once a second
# and expects one "host:slots" line per host that may run workers now.
#
#   discover_hosts.sh HOSTFILE   static list, re-read at every call: edit the file to add or remove
#                                hosts while the job runs. Lines: "host:slots", "host slots=N" or
#                                "host" (1 slot); '#' starts a comment.
#   discover_hosts.sh            inside a Slurm job: the job's nodes (SLURM_JOB_NODELIST, expanded by
#                                `scontrol show hostnames`, or by hvdtrain's own parser where scontrol
#                                is missing), SLURM_NTASKS_PER_NODE slots each (default 1).
#
# A host missing from the output is removed (its workers stop at the next commit); one that comes
# back is added again. Exit status non-zero (an unreadable file) makes horovodrun stop the job.
set -eu

if [ $# -ge 1 ]; then
    [ -r "$1" ] || { echo "discover_hosts.sh: cannot read host file $1" >&2; exit 1; }
    sed -e 's/#.*//' "$1" | awk '
        NF == 0 { next }
        $1 ~ /:/ { print $1; next }
        NF == 1 { print $1 ":1"; next }
        { line = $0; sub(/^[^ \t]+[ \t]+/, "", line); gsub(/[ \t]/, "", line)
          if (line ~ /^slots=[0-9]+$/) { sub(/slots=/, "", line); print $1 ":" line }
          else { print "discover_hosts.sh: bad line: " $0 > "/dev/stderr"; exit 1 } }'
    exit $?
fi

nodes="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
[ -n "$nodes" ] || { echo "discover_hosts.sh: pass a host file, or run inside a Slurm job" >&2; exit 1; }
slots="${SLURM_NTASKS_PER_NODE:-1}"
slots="${slots%%(*}"  # "2(x3)" -> 2
if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$nodes"
else
    python3 -c 'import sys; from hvdtrain.tools.hosts import expand_nodelist; print("\n".join(expand_nodelist(sys.argv[1])))' "$nodes"
fi | sed "s/\$/:$slots/"
