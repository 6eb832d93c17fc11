#!/usr/bin/env bash
# kvtier as a user installs it: build the wheel from the working tree, install it with its testing
# extra, and the example plugin, into a virtual environment of their own (no editable install, no
# system site packages), and run the command line and the example plugin's tests (kvtier's contract
# suites among them) against them from a directory outside the checkout.
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
	# The contract suites' own dependencies come with the testing extra, as a plugin author gets them.
	"${pip[@]}" install "$(echo "$work"/wheels/kvtier-[0-9]*.whl)[testing]" \
		"$work"/wheels/kvtier_example-*.whl
	echo "$deps" >"$stamp"
else
	"${pip[@]}" install --force-reinstall --no-deps "$work"/wheels/*.whl
fi

cd "$work"
bin=$venv/bin
# The installed copy is what runs, and it holds every package and contract suite of the source
# tree, each importable with what the testing extra installed.
"$bin/python" - "$repo" "$venv" <<'PY'
import importlib
import sys
from pathlib import Path

import kvtier

repo, venv = Path(sys.argv[1]), Path(sys.argv[2])
installed = Path(kvtier.__file__).parent
assert installed.is_relative_to(venv), f"kvtier was imported from outside {venv}: {installed}"
packages = {p.parent.relative_to(repo) for p in (repo / "kvtier").rglob("__init__.py")}
missing = sorted(str(p) for p in packages if not (installed.parent / p / "__init__.py").exists())
assert not missing, f"the wheel lacks {', '.join(missing)}"
suites = sorted(p.stem for p in (repo / "kvtier" / "testing").glob("contracts_*.py"))
assert suites, "no contract suite in the checkout"
for suite in suites:
    module = importlib.import_module(f"kvtier.testing.{suite}")
    assert Path(module.__file__).is_relative_to(installed), module.__file__
print(f"kvtier {kvtier.__version__} from {installed}, with {', '.join(suites)}")
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
# The example plugin's tests, copied out of the checkout: kvtier, its contract suites and the plugin
# all come from the environment (the test asserts it too).
cp -r "$repo/plugins/kvtier-example/tests" plugin-tests
cat >plugin-tests/conftest.py <<PY
from pathlib import Path

import kvtier
import kvtier_example


def pytest_sessionstart(session):
    for module in (kvtier, kvtier_example):
        assert Path(module.__file__).is_relative_to("$venv"), module.__file__
PY
"$bin/python" -m pytest -q -p no:cacheprovider --rootdir plugin-tests plugin-tests
echo "wheel check passed"
