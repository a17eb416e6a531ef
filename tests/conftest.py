import os

import pytest
import torch

# Keep CPU tests small and deterministic on 2-core CI machines.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# torchrun's variables: a test that initializes megatron-core's parallel state in the pytest
# process (plain-python runs set RANK / WORLD_SIZE / LOCAL_RANK for their own process) would leave
# them for every later subprocess test, which then fails far from the cause ("MASTER_ADDR
# expected"). Such state belongs in a spawned process (tests/dist_utils.run_distributed).
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def _no_launch_vars_left():
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    left = {k: os.environ.get(k) for k in _LAUNCH_VARS if os.environ.get(k) != before[k]}
    for k, v in before.items():  # restored, so the tests after this one run as they would
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if left:
        pytest.fail(f"the test changed torchrun's variables in the pytest process: {left}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def byo_page(tmp_path_factory):
    """docs/byo_task.md run as written (``tests/docs_pages.py``), once per session: its
    directory and its commands' results."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("transformers")
    from tests.docs_pages import ROOT, run_page

    cwd = tmp_path_factory.mktemp("docs_session")
    return cwd, run_page(ROOT / "docs" / "byo_task.md", cwd)


@pytest.fixture(scope="session")
def conversion_page(byo_page):
    """docs/conversion.md run as written, once per session, in byo_page's directory (the docs
    in reader order: its commands must not meet the first page's outputs)."""
    from tests.docs_pages import ROOT, run_page

    cwd = byo_page[0]
    return cwd, run_page(ROOT / "docs" / "conversion.md", cwd)
