#!/bin/bash
# Runs each upstream module in the scratch folder on its own (a module's servers start and stop with it) and
# prints the tally. Needs: pip install pytest-asyncio jsonschema (and hypothesis hypothesis-torch pybase64, which
# test_prompt_validation.py imports). On 2 CPU cores the whole run takes about an hour.
set -uo pipefail
dest=${1:-/tmp/upstream_tests}
out="$dest/results/${2:-run}"
mkdir -p "$out"
cd "$dest"
for f in tests/entrypoints/openai/test_*.py; do
    m=$(basename "$f" .py)
    python -m pytest -q -rA -p no:cacheprovider --junitxml="$out/$m.xml" "$f" > "$out/$m.log" 2>&1
    tail -n 1 "$out/$m.log" | sed "s/^/$m: /"
done
python - "$out" <<'PY'
import sys, glob, xml.etree.ElementTree as ET
passed = failed = 0
for path in sorted(glob.glob(sys.argv[1] + "/*.xml")):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        cases = int(suite.get("tests")) - int(suite.get("skipped"))
        bad = int(suite.get("failures")) + int(suite.get("errors"))
        passed, failed = passed + cases - bad, failed + bad
print(f"upstream server cases: {passed} passed of {passed + failed}")
PY
