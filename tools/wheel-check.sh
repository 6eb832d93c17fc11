#!/usr/bin/env bash
# kvtier as a user installs it: build the wheel from the working tree, install it, and the example
# plugin, into a virtual environment of their own (no editable install, no system site packages),
# and run the command line against them from a directory outside the checkout.
#
#   tools/wheel-check.sh [VENV]      (default: .venv-wheel in the checkout)
#
# The environment's third-party packages (CPU torch and the build backend first, then kvtier's
# dependencies) are installed once per version of the two pyproject.toml files; kvtier and the
# example plugin are built and reinstalled on every run.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(realpath -m "${1:-$repo/.venv-wheel}")  # absolute: the checks run from another directory
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH

# Build from a copy of the files git tracks or would track, so the checkout gets no build/.
mkdir "$work/src" "$work/wheels"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
	| while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done \
	| tar --null -cf - -T -) | tar -xf - -C "$work/src"

stamp=$venv/.kvtier-deps
deps=$(cat "$repo/pyproject.toml" "$repo/plugins/kvtier-example/pyproject.toml" | sha256sum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$deps" ]; then
	rm -rf "$venv"
	"$python" -m venv "$venv"
	"$venv/bin/pip" install -q torch==2.13.0 'setuptools>=68'
	fresh=1
fi
pip=("$venv/bin/pip" -q)
# The build backend both pyproject.toml files name is in the environment: no isolated one to make.
"${pip[@]}" wheel --no-deps --no-build-isolation -w "$work/wheels" "$work/src" \
	"$work/src/plugins/kvtier-example"
if [ "${fresh:-0}" = 1 ]; then
	"${pip[@]}" install "$work"/wheels/*.whl
	echo "$deps" >"$stamp"
else
	"${pip[@]}" install --force-reinstall --no-deps "$work"/wheels/*.whl
fi

cd "$work"
bin=$venv/bin
# The installed copy is what runs, and it holds every package of the source tree.
"$bin/python" - "$repo" <<'PY'
import sys
from pathlib import Path

import kvtier

repo = Path(sys.argv[1])
installed = Path(kvtier.__file__).parent
assert installed != repo / "kvtier", f"kvtier was imported from the checkout: {installed}"
packages = {p.parent.relative_to(repo) for p in (repo / "kvtier").rglob("__init__.py")}
missing = sorted(str(p) for p in packages if not (installed.parent / p / "__init__.py").exists())
assert not missing, f"the wheel lacks {', '.join(missing)}"
print(f"kvtier {kvtier.__version__} from {installed}")
PY
"$bin/kvtier" plugins | grep -E '^eviction policy +fifo +kvtier-example '
"$bin/kvtier" config validate "$repo/docs/examples/minimal.yaml"
printf 'cpu_bytes: 1GiB\nindex:\n  type: fifo\n' >fifo.yaml
"$bin/kvtier" config validate fifo.yaml
"$bin/kvtier" simulate synthetic:chat --policies lru,fifo --capacities 500 \
	--synthetic-requests 200 --no-belady --json >simulate.json
"$bin/python" - <<'PY'
import json

results = json.load(open("simulate.json"))["results"]
assert [r["policy"] for r in results] == ["lru", "fifo"], results
assert all(r["tier_hits"] > 0 for r in results), results
print("simulate: " + ", ".join(f"{r['policy']} {r['hit_rate']:.3f}" for r in results))
PY
echo "wheel check passed"
