#!/usr/bin/env bash
# The test suite: set up on first use, then pytest. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest "$@"
