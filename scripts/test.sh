#!/usr/bin/env bash
# Install everything (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit $rc
