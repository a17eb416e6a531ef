"""The modules behind ``tools/bench_train_passes.py`` (its docstring says what it measures).

``shapes`` (model presets) and ``cli`` (flags, defaults, validation) are torch-free: the entry
point parses its arguments and sets the environment (``TRITON_INTERPRET`` for ``--device cpu``)
before it imports the rest. ``dist`` holds the torchrun layout (``--ep N`` / ``--tp N``),
``models`` the variants, ``batches`` the packed micro-batches, ``flops`` the FLOP and MFU
arithmetic, ``timing`` the clocks and the GEMM floor, ``passes`` the timed rows, ``profiling``
the kernel and host profiles, ``report`` the tables and run info, ``run`` the driver.
"""
