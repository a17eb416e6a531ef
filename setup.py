"""megatron-grpo: fast, memory-lean, numerically safe GRPO-family RL on Megatron-Core."""

from setuptools import find_packages, setup

# `kernels/` lives at the top level of the repository but is installed as
# `megatron_grpo.kernels`: a top-level `kernels` import name would collide with
# an unrelated package of that name on PyPI.
_packages = find_packages(include=["megatron_grpo", "megatron_grpo.*"])
_packages += ["megatron_grpo.kernels"] + [
    "megatron_grpo.kernels." + p for p in find_packages(where="kernels")
]

setup(
    name="megatron-grpo",
    version="0.1.0",
    description="GRPO-family RL training on Megatron-Core: vocab-parallel fused log-probs and "
    "a numerically safe GRPO loss family",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=_packages,
    package_dir={"megatron_grpo.kernels": "kernels"},
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.14",
        "pyyaml>=6",
        "numpy",
        "safetensors>=0.4",
        "psutil",  # megatron-core's torch_dist checkpoint writer needs it (else save hangs)
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "ruff==0.17.6",
            "triton>=3.2",
            "transformers>=4.51",
            "pyarrow",
            "tensorboard",
        ],
        "te": ["transformer-engine[pytorch]>=2.0"],
        "data": ["pyarrow"],  # Parquet datasets and rollout files
        "tools": ["transformers>=4.51"],
    },
    entry_points={"console_scripts": ["megatron-grpo-train=megatron_grpo.train.__main__:main"]},
)
