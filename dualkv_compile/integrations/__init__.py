"""One-line ways to turn dualkv on in trainers (none of them imports the trainer library at import time).

* ``integrations.trl.enable(trainer)``: TRL's ``GRPOTrainer``.
* ``actor_rollout_ref.model.external_lib=dualkv_compile.integrations.verl``: veRL 0.9's FSDP engine (importing
  that module turns it on, so it is not imported here).
* ``integrations.hf_checkpointing.checkpoint_inside_hooks(model)``: Hugging Face checkpointing that Dynamo can
  compile under FSDP2 per layer (both integrations apply it; a loop of your own calls it once).
"""

from . import hf_checkpointing, trl

__all__ = ["hf_checkpointing", "trl"]
