#!/usr/bin/env bash
# Print the path of the newest usable Python (>= 3.11), or fail.
#
#   scripts/find-python.sh            # newest of 3.13, 3.12, 3.11, then plain python3
#   scripts/find-python.sh 3.11       # a 3.11 exactly
#
# pyenv shims (e.g. python3.13) exist for every installed version but fail unless that
# version is selected, so each candidate is run, not just found, and pyenv's own
# installs are tried directly too.
set -euo pipefail

exact=${1:-}
if [[ -n $exact ]]; then versions=("$exact"); else versions=(3.13 3.12 3.11); fi

pyenv_root=""
if command -v pyenv >/dev/null 2>&1; then pyenv_root=$(pyenv root 2>/dev/null || true); fi

usable() {  # usable CANDIDATE [X.Y]
  local cand=$1 want=${2:-}
  [[ -n $cand ]] || return 1
  "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 || return 1
  [[ -z $want ]] || [[ $("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])') == "$want" ]]
}

for v in "${versions[@]}"; do
  candidates=()
  cmd=$(command -v "python$v" 2>/dev/null || true)
  [[ -n $cmd ]] && candidates+=("$cmd")
  if [[ -n $pyenv_root ]]; then
    # Newest patch release first.
    while IFS= read -r p; do candidates+=("$p"); done < <(
      ls -d "$pyenv_root"/versions/"$v"*/bin/python"$v" 2>/dev/null | sort -rV
    )
  fi
  for cand in "${candidates[@]}"; do
    if usable "$cand" "$v"; then
      "$cand" -c 'import sys; print(sys.executable)'  # the real binary, not a shim
      exit 0
    fi
  done
done

if [[ -z $exact ]]; then
  cmd=$(command -v python3 2>/dev/null || true)
  if usable "$cmd"; then
    "$cmd" -c 'import sys; print(sys.executable)'
    exit 0
  fi
fi

if [[ -n $exact ]]; then
  echo "error: no working Python $exact found (tried python$exact${pyenv_root:+ and pyenv versions})" >&2
else
  echo "error: no working Python >= 3.11 found (tried python3.13, python3.12, python3.11${pyenv_root:+, pyenv versions}, python3)" >&2
fi
exit 1
