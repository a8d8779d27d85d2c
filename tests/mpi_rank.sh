#!/bin/sh
# Run one rank's command under mpirun. Rank 0 reports on the terminal; the other ranks
# keep their output in a log that is printed only if that rank fails.
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
[ "$rank" = 0 ] && exec "$@"
log=$(mktemp)
"$@" >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  { echo "---- output of rank $rank (exit $rc) ----"; cat "$log"; } >&2
fi
rm -f "$log"
exit $rc
