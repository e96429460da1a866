"""Fast recovery: a node-local RAM tier replicated to other hosts (``TieredCheckpointManager``
with ``replicas >= 1``). Modules, in the order a save and a recovery use them: ``group`` (the
tier's gloo group, hosts, agents), ``placement`` (the ring), ``replicate`` (copies + commit
markers), ``inventory`` (one host's RAM layout), ``durable`` (the durable copy from RAM),
``finite`` (the optional NaN/Inf check), ``decide`` (the one decision), ``restore`` (materialise
the chosen step in every host's RAM), ``tier`` (the glue, and the SIGTERM flush). Guide:
docs/guide/recovery.md."""

from .restore import RecoveryReport

__all__ = ["RecoveryReport"]
