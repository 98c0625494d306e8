#!/usr/bin/env bash
# multiworker.sh: start and supervise the processes of one tfllm DTensor multi-client job.
#
# A thin wrapper: the launcher is Python (tfllm/launch/: topology as pure functions, a
# supervisor, the options), also available as `tfllm launch`. This script keeps its name,
# options, exit codes and --help. It runs from a checkout without installing tfllm.
# Run it with --help for the options and exit codes.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=""
for candidate in "${PYTHON:-}" python3 python; do
  if [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1; then
    python=$candidate
    break
  fi
done
if [[ -z $python ]]; then
  echo "multiworker.sh: error: no python found (python3 or python, or set PYTHON=/path/to/python)" >&2
  exit 2
fi
# exec: signals to this script reach the launcher itself, which forwards them.
exec env PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -m tfllm.launch \
  --prog multiworker.sh "$@"
