"""One-line ways to turn dualkv on in trainers (none of them imports the trainer library itself).

* ``integrations.trl.enable(trainer)``: TRL's ``GRPOTrainer``.
* veRL-style actors: decorate the actor's loss with ``@dualkv_compile.policy_loss``
  (``examples/verl_style_batch.py``, padded or ``--remove-padding``).
"""

from . import trl

__all__ = ["trl"]
