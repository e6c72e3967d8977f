#!/usr/bin/env bash
# Install everything (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
set +e
# Two processes (pytest-xdist), each running whole files: most of the suite's time is learner and worker
# subprocesses waiting on each other, so two at once finish sooner even on 2 cores. TEST_PROCESSES=0: one.
.venv/bin/python -m pytest -n "${TEST_PROCESSES:-2}" --dist loadfile "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit $rc
