"""The documented path of a module that moved: this name is that module (see the import)."""

import sys

from megatron_grpo.megatron.attention import rope as _module

sys.modules[__name__] = _module
