#!/usr/bin/env bash
# Make sure a virtualenv exists and has the given packages installed.
#
#   scripts/venv.sh VENV_DIR [--python X.Y] PIP_ARGS...
#   scripts/venv.sh .venv -e '.[example,postgres,dev]'
#   scripts/venv.sh .venv-dj52 --python 3.11 -e '.[test]' 'Django>=5.2,<5.3'
#
# pip runs only when pyproject.toml or the requested packages changed since the last
# successful install (a stamp file in the venv records them), so repeated `make` calls
# are quick. A venv whose interpreter no longer runs is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:?usage: scripts/venv.sh VENV_DIR [--python X.Y] PIP_ARGS...}
shift
want=""
if [[ ${1:-} == --python ]]; then
  want=${2:?--python needs a version}
  shift 2
fi

py="$venv/bin/python"
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 \
  || { [[ -n $want ]] && [[ $("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') != "$want" ]]; }; then
  base=$(scripts/find-python.sh $want)
  echo "==> creating $venv with $base ($("$base" --version 2>&1))"
  rm -rf "$venv"
  "$base" -m venv "$venv"
fi

stamp="$venv/.agentruns-installed"
wanted=$( { cat pyproject.toml; printf '%s\n' "$@"; } | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$wanted" ]]; then
  echo "==> installing into $venv: $*"
  "$py" -m pip install --quiet "$@"
  echo "$wanted" >"$stamp"
fi
