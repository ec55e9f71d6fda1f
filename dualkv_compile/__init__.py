"""dualkv_compile: compute each shared prompt once in GRPO-style policy updates.

``torch.compile(model, backend="dualkv")`` packs the rows of a batch that
share a prompt into one stream (prompt once, then each response) across the
whole model, with attention lowered to ``shared_prompt_attention``.
"""
from .backend import dualkv_backend, register as _register
from .config import DualKVConfig
from .report import reports
from .explain import Explanation, explain
from .ops.attention import shared_prompt_attention
from .layout import Segments, SharedPromptLayout, detect, pack, unpack
from .policy_loss import policy_loss
from .shared_batch import shared_batch
from .runtime.exactness_check import ExactnessError
from . import distributed  # check_groups_on_rank: the data-parallel data-loader check
from . import integrations  # integrations.trl.enable(trainer)
from . import schedule  # schedule.prefix_once_step: a group's prompt once across its micro-batches
from .integrations.hf_hybrids import install as _install_hf_hybrids
from .integrations.hf_vision import images_once  # each distinct image once through a VLM's vision tower

_register()
_install_hf_hybrids()  # hybrids' recurrent cores (GDN, Mamba-2) as ops in every Dynamo graph (integrations.hf_hybrids)

__all__ = [
    "DualKVConfig",
    "ExactnessError",
    "Explanation",
    "Segments",
    "SharedPromptLayout",
    "detect",
    "dualkv_backend",
    "explain",
    "images_once",
    "pack",
    "policy_loss",
    "reports",
    "shared_batch",
    "shared_prompt_attention",
    "unpack",
]
