#!/bin/bash
# Lays out a scratch folder (default /tmp/upstream_tests) where upstream's test files find this harness as their
# tests/utils.py and tests/conftest.py. Needs GitHub access; upstream's files stay in the scratch folder.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-/tmp/upstream_tests}
mkdir -p "$dest/tests/entrypoints/openai"
touch "$dest/tests/__init__.py" "$dest/tests/entrypoints/__init__.py" "$dest/tests/entrypoints/openai/__init__.py"
cp "$here/harness/utils.py" "$here/harness/conftest.py" "$dest/tests/"
cp -r "$here/harness/genconfig" "$dest/"
cp "$here/harness/pytest.ini" "$dest/"
grep -v '^#' "$here/upstream_files.txt" | while read -r name commit; do
    curl -fsSL "https://raw.githubusercontent.com/vllm-project/vllm/$commit/tests/entrypoints/openai/$name" \
        -o "$dest/tests/entrypoints/openai/$name"
done
echo "upstream tests laid out in $dest; run: $here/run_upstream_tests.sh $dest"
