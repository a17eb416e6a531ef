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

# install_tree DIR: another source tree of this package (`git archive BASE | tar -x -C DIR`)
# installed, not editable, into DIR/.site; prints that directory, for PYTHONPATH. A tree put on
# PYTHONPATH as it is brings its megatron_grpo but not its kernels: `megatron_grpo.kernels` is
# setup.py's mapping of the top-level kernels/, which this checkout's editable install answers,
# so a before / after of a kernel would run this checkout's kernels on both sides.
install_tree() {
    [ -f "$1/setup.py" ] || { echo "install_tree: $1 has no setup.py (archive the whole tree)" >&2; return 1; }
    rm -rf "$1/.site" "$1/build"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --target "$1/.site" "$1" >&2 || return 1
    echo "$(cd "$1/.site" && pwd)"
}
