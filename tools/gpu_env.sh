#!/usr/bin/env bash
# Sourced by tools/gpu_suite.sh and tools/gpu_e2e.sh on a lent GPU machine.
#
# install_carried: megatron-core (and cut-cross-entropy) from the wheels carried in $WHEELS into
# /tmp/site (their dependencies: torch, numpy, packaging, triton, are in the GPU image), then
# this package, without dependencies. Returns non-zero when an install fails.
install_carried() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHEELS"/*.whl || return 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no wheels in $WHEELS/: megatron-core (and cut-cross-entropy) must be installed"
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
}
